import os
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests"))


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """Fresh random inputs on every run; a failure prints DS_TEST_SEED to reproduce it."""
    seed = int(os.environ.get("DS_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        for key, value in item.user_properties:
            if key == "seed":
                report.sections.append(("seed", f"reproduce with DS_TEST_SEED={value}"))
    return report


# One pool of real gloo worker processes per test module and world size (tests/dist_pool.py).
@pytest.fixture(scope="module")
def pool2():
    from dist_pool import DistributedPool

    pool = DistributedPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def pool3():
    from dist_pool import DistributedPool

    pool = DistributedPool(3)
    yield pool
    pool.close()


def copy_tracked_tree(destination: Path) -> Path:
    """Copies the tracked (and untracked, not ignored) files to `destination`: a clean source
    tree with no build/, no compiled library and no venv, as a fresh clone would have."""
    import subprocess

    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO_ROOT, capture_output=True, text=True, check=True)  # fmt: skip
    for name in files.stdout.splitlines():
        if (REPO_ROOT / name).is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            (destination / name).write_bytes((REPO_ROOT / name).read_bytes())
    return destination
