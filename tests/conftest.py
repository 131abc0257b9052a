import os
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests"))


# The op libraries compiled in the background while the session runs (tests/prebuild_ops.py): a
# fresh checkout compiles every op, and most of the suite leaves one of the two cores idle.
# Niced, so the tests keep the CPU they ask for; stopped (its whole process group, compilers
# included) when the session ends, a half-done build being cleared by the next one that needs it.
_PREBUILD: list = []
_SESSION_DIRS: list[str] = []


def pytest_sessionstart(session):
    import shutil
    import subprocess

    if session.config.option.collectonly:
        return
    # The 2-rank pool most modules use starts now, its workers importing torch beside the
    # collection (tests/dist_pool.py), not when its first test asks for it.
    from dist_pool import prestart

    prestart(2)
    if os.environ.get("DS_TEST_PREBUILD", "1") == "0":
        return
    # Builds made once per session, by the background or by the test that needs one first
    # (tests/session_builds.py); seen by both through the environment.
    import tempfile

    _SESSION_DIRS.append(tempfile.mkdtemp(prefix="ds_test_session_"))
    os.environ["DS_TEST_BACKGROUND_DIR"] = _SESSION_DIRS[-1]
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    # This checkout's deepspeed_cpp, as the tests import it (not another one installed).
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    _PREBUILD.append(
        subprocess.Popen(
            [*nice, sys.executable, str(REPO_ROOT / "tests" / "prebuild_ops.py")],
            env=dict(os.environ, PYTHONPATH=path),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    )


# The background's builds for a test, made only when the session runs that test (the prebuild
# waits for this list after the CPU ops; tests/prebuild_ops.py).
BACKGROUND_BUILDS = {
    "fused_adam_wheel": ("test_fused_adam_build.py::test_wheel_build_holds_each_architecture",),
    "moe_cuda": ("test_moe_gating_cuda.py::test_cuda_kernel_builds_and_registers",),
    "stable_abi_wheel": ("test_op_loading.py::", "test_stable_abi_wheel.py::"),
    "other_torch_venv": (
        "test_stable_abi_wheel.py::test_wheel_loads_prebuilt_under_torch_2_13_without_a_compiler",
        "test_stable_abi_wheel.py::test_cpu_adam_and_a_zero2_step_pass_under_torch_2_13",
    ),
}


def pytest_collection_finish(session):
    if not _SESSION_DIRS:
        return
    wanted = [
        build
        for build, tests in BACKGROUND_BUILDS.items()
        if any(test in item.nodeid for test in tests for item in session.items)
    ]
    partial = Path(_SESSION_DIRS[-1]) / "wanted.partial"
    partial.write_text("\n".join(wanted))
    partial.rename(partial.with_name("wanted"))


def pytest_sessionfinish(session, exitstatus):
    import shutil
    import signal

    for process in _PREBUILD:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    _PREBUILD.clear()
    for folder in _SESSION_DIRS:  # this session's only (a nested pytest inherits the variable)
        shutil.rmtree(folder, ignore_errors=True)
        if os.environ.get("DS_TEST_BACKGROUND_DIR") == folder:
            del os.environ["DS_TEST_BACKGROUND_DIR"]
    _SESSION_DIRS.clear()


@pytest.fixture
def ds_log(caplog):
    """The 'deepspeed_cpp' logger's warnings (it does not propagate to the root logger), each
    config key warned afresh (config warnings come once per key and process)."""
    import logging

    from deepspeed_cpp.runtime.config.deepspeed_config import forget_warnings

    forget_warnings()
    logger = logging.getLogger("deepspeed_cpp")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING, logger="deepspeed_cpp")
    yield caplog
    logger.removeHandler(caplog.handler)


@pytest.fixture(scope="session")
def aio_library():
    """The aio op compiled and loaded once, before any subprocess of a test needs it (files
    using aio ask for it with ``pytestmark = pytest.mark.usefixtures("aio_library")``)."""
    from deepspeed_cpp.ops import aio

    aio.load_aio()


@pytest.fixture
def nvme(tmp_path):
    """An nvme_path on a real disk file system (O_DIRECT exercised): pytest's temporary folder
    when it is one, else one under the repository's build/."""
    import shutil

    from disk_folders import on_a_real_disk

    folder = tmp_path / "nvme"
    if not on_a_real_disk(tmp_path):
        folder = REPO_ROOT / "build" / f"swap_test_{os.getpid()}_{tmp_path.name}"
    folder.mkdir(parents=True, exist_ok=True)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


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


# One pool of real gloo worker processes per world size for the whole session (tests/dist_pool.py):
# started once, shared by every module; a pool torn down by a hung job is replaced at the next run.
@pytest.fixture(scope="session")
def pool2():
    from dist_pool import SessionPool

    return SessionPool(2)


@pytest.fixture(scope="session")
def pool3():
    from dist_pool import SessionPool

    return SessionPool(3)


@pytest.fixture(scope="session")
def pool4():
    from dist_pool import SessionPool

    return SessionPool(4)


@pytest.fixture(scope="session")
def pools():
    """pools(world_size): the session's pool of that many ranks."""
    from dist_pool import SessionPool

    return SessionPool


@pytest.fixture(scope="session", autouse=True)
def _close_shared_pools():
    yield
    from dist_pool import close_shared_pools

    close_shared_pools()


@pytest.fixture(scope="session")
def prebuilt_cpu_adam_wheel(tmp_path_factory):
    """The shared pre-built wheel (tests/session_builds.py: cpu_adam and the schema library on
    PyTorch's stable C ABI, so abi3 and serving every torch from 2.13 on), built in the session's
    background or now. test_op_loading.py installs it next to this torch; test_stable_abi_wheel.py
    into a venv with torch 2.13.0."""
    from session_builds import stable_abi_wheel

    built = stable_abi_wheel(tmp_path_factory.mktemp("prebuilt"))
    assert "error" not in built, built.get("error")
    return Path(built["wheel"])
