"""One wheel across torch versions: the shared stable-ABI wheel (conftest.py), built under this
torch, installed into a fresh venv with torch 2.13.0 (the CPU build), where cpu_adam must load
pre-built, match torch's AdamW and the float64 reference, and a ZeRO-2 step must train on 2 gloo
ranks. The zero op holds c10d process groups and custom classes, which have no stable-ABI form:
it stays on the regular ABI and is compiled just in time for 2.13.0 there.

torch 2.13.0 comes from the wheel cache scripts/setup_env.sh fills (.cache/other-torch) or from
pip's configured indexes; when neither has it the test fails saying so, it never skips.

torch 2.13.0 does not depend on this checkout: it is unpacked once per machine (about 10 s) into
~/.cache/deepspeed_cpp/other-torch and reused; the venv, the wheel, its install and the zero op's
JIT build for 2.13.0 are new on every run.
"""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from conftest import REPO_ROOT

OTHER_TORCH = "2.13.0+cpu"
WHEEL_CACHE = Path(os.environ.get("DS_OTHER_TORCH_WHEELS", REPO_ROOT / ".cache" / "other-torch"))

# Run in the other venv with no compiler: everything must come from the wheel, and only there.
PREBUILT_CHECK = """
import sys
import torch
import deepspeed_cpp
from deepspeed_cpp.ops import cpu_adam_step
from deepspeed_cpp.ops.op_builder import CPUAdamBuilder, RegistryBuilder
site = sys.argv[1]
assert torch.__version__ == sys.argv[2], torch.__version__
assert deepspeed_cpp.__file__.startswith(site), deepspeed_cpp.__file__
p, g, m, v = torch.ones(9), torch.ones(9), torch.zeros(9), torch.zeros(9)
cpu_adam_step(p, g, m, v, step=1, lr=0.5)
assert torch.equal(p, torch.full((9,), 0.5)), p
for op in (RegistryBuilder(), CPUAdamBuilder()):
    library = str(op.loaded_library())
    assert library.startswith(site + "/deepspeed_cpp/_ops/"), library
    assert library.endswith(".abi3.so"), library
print("PREBUILT OK", torch.__version__)
"""

# The smoke subset: the op against float64 and torch's AdamW, its messages and opcheck through
# the stable ABI of the older torch, and one ZeRO-2 run (5 steps, 2 gloo ranks) against AdamW.
SMOKE_TESTS = [
    "test_cpu_adam_op.py::test_matches_torch_float64",
    "test_cpu_adam_op.py::test_multi_tensor_equals_single_tensor_bitwise",
    "test_cpu_adam_op.py::test_opcheck_single_and_multi",
    "test_cpu_adam_op.py::test_bad_input_names_argument_value_and_expectation",
    "test_cpu_adam_optimizer.py::test_training_matches_torch_optimizer_in_float64",
    "test_engine_zero.py::test_matches_single_process_adamw_2_ranks[2-fp32-1-0.5]",
]


def _env(**overrides) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DS_BUILD_")}
    env.pop("PYTHONPATH", None)  # the source tree must not shadow the installed wheel
    env.update(overrides)
    return env


def _run(args, cwd, timeout=900, **env):
    return subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _other_torch_site() -> Path:
    """torch 2.13.0 unpacked into a folder of its own, once per machine: installed into a
    temporary sibling first and renamed into place complete, so a run that stops half-way or a
    second run at the same time never sees a partial torch."""
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    root = Path.home() / ".cache" / "deepspeed_cpp" / "other-torch"
    site = root / f"torch-{OTHER_TORCH}-{python}"
    if (site / "torch" / "version.py").is_file():
        return site
    root.mkdir(parents=True, exist_ok=True)
    partial = root / f".partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    find_links = ["--find-links", WHEEL_CACHE] if WHEEL_CACHE.is_dir() else []
    torch_install = _run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--only-binary=:all:",
         *find_links, "--target", partial, f"torch=={OTHER_TORCH}"],
        cwd=root,
    )  # fmt: skip
    if torch_install.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        pytest.fail(
            f"torch {OTHER_TORCH} could not be installed into {partial}, so the stable-ABI wheel "
            f"cannot be tried under another torch. Run scripts/setup_env.sh (it downloads the "
            f"wheel into {WHEEL_CACHE}) or set DS_OTHER_TORCH_WHEELS to a folder holding "
            f"torch-{OTHER_TORCH}-*.whl. pip said:\n{torch_install.stderr[-2000:]}"
        )
    try:
        partial.rename(site)
    except OSError:  # another run put its complete copy there first
        shutil.rmtree(partial, ignore_errors=True)
    return site


@pytest.fixture(scope="module")
def other_torch_venv(prebuilt_cpu_adam_wheel, tmp_path_factory):
    """A venv whose own site-packages holds the wheel, then (through .pth lines, in name order)
    torch 2.13.0 and after it the rest (numpy, pydantic, pytest, torch's pure-Python
    dependencies) seen from this environment: nothing else is downloaded or shadows torch."""
    root = tmp_path_factory.mktemp("other_torch")
    venv = root / "venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=root)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    theirs = Path(_run([python, "-c", purelib], cwd=root).stdout.strip())
    (theirs / "a_other_torch.pth").write_text(f"{_other_torch_site()}\n")
    ours = _run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", theirs,
         prebuilt_cpu_adam_wheel],
        cwd=root,
    )  # fmt: skip
    assert ours.returncode == 0, ours.stderr
    # Read after a_other_torch.pth: this environment's torch 2.14 comes after 2.13.0 on sys.path.
    (theirs / "our_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python, theirs


def _tool_path(python: Path) -> str:
    # ninja (torch's JIT builds) lives beside this interpreter.
    return os.pathsep.join(
        [str(python.parent), str(Path(sys.executable).parent), os.environ["PATH"]]
    )


def test_wheel_loads_prebuilt_under_torch_2_13_without_a_compiler(other_torch_venv, tmp_path):
    python, theirs = other_torch_venv
    ran = _run(
        [python, "-c", PREBUILT_CHECK, theirs, OTHER_TORCH],
        cwd=tmp_path,
        CXX=str(tmp_path / "no-such-compiler"),
        DS_CPP_EXTENSIONS_DIR=str(tmp_path / "empty-cache"),
        PATH=_tool_path(python),
    )
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert f"PREBUILT OK {OTHER_TORCH}" in ran.stdout
    assert "just in time" not in ran.stderr
    assert not (tmp_path / "empty-cache").exists()


def test_cpu_adam_and_a_zero2_step_pass_under_torch_2_13(other_torch_venv, tmp_path):
    python, _ = other_torch_venv
    tests = [REPO_ROOT / "tests" / name for name in SMOKE_TESTS]
    ran = _run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        cwd=tmp_path,
        DS_CPP_EXTENSIONS_DIR=str(tmp_path / "jit"),  # the zero op, compiled for 2.13.0
        DS_TEST_PREBUILD="0",  # conftest's background builds would compile the source tree's ops
        PATH=_tool_path(python),
    )
    assert ran.returncode == 0, ran.stdout[-5000:] + ran.stderr[-3000:]
    assert " failed" not in ran.stdout and " skipped" not in ran.stdout, ran.stdout[-3000:]
    assert " passed" in ran.stdout, ran.stdout[-3000:]


# What a library may take from torch to load under another torch: the stable ABI's C functions.
# C++ symbols of torch (c10::, at::, torch::) change with every release. The few std:: functions
# newer than the oldest libstdc++ around (std::__throw_bad_array_new_length, ...) are found in
# libstdc++ or in libc10, which exports its own copies.
_C_SHIM = re.compile(r"^(aoti_torch_|torch_)\w+$")
_CXX_STD = re.compile(r"^_Z(N[KOR]*)?St")


def test_libraries_call_torch_only_through_its_c_shim(prebuilt_cpu_adam_wheel, tmp_path):
    with zipfile.ZipFile(prebuilt_cpu_adam_wheel) as wheel:
        names = [n for n in wheel.namelist() if n.endswith(".so")]
        wheel.extractall(tmp_path, members=names)
    for name in names:
        listed = _run(["nm", "-D", "--undefined-only", tmp_path / name], cwd=tmp_path)
        assert listed.returncode == 0, listed.stderr
        symbols = [line.split()[-1] for line in listed.stdout.splitlines() if line.strip()]
        # Versioned ones (pow@GLIBC_2.29) come from the C and C++ runtimes, weak ones are unused.
        unversioned = [s for s in symbols if "@" not in s and not s.startswith(("_ITM_", "__gmon"))]
        foreign = [s for s in unversioned if not _C_SHIM.match(s) and not _CXX_STD.match(s)]
        assert not foreign, f"{name} needs torch C++ symbols, not the stable ABI: {foreign}"
        assert any(_C_SHIM.match(s) for s in unversioned), f"{name} registers nothing? {symbols}"


def test_wheel_is_manylinux_2_28_compatible(prebuilt_cpu_adam_wheel, tmp_path):
    """auditwheel finds no symbol version above glibc 2.28 / gcc 8's runtimes in the wheel's
    libraries nor in the torch libraries they load (found through LD_LIBRARY_PATH, as in the
    README's repair command): `auditwheel repair --plat manylinux_2_28_<arch>` can tag it."""
    import json
    import platform

    import torch

    shown = _run(
        [sys.executable, "-m", "auditwheel", "show", "--json", prebuilt_cpu_adam_wheel],
        cwd=tmp_path,
        timeout=300,
        LD_LIBRARY_PATH=str(Path(torch.__file__).parent / "lib"),
    )
    assert shown.returncode == 0, shown.stdout[-3000:] + shown.stderr[-3000:]
    report = json.loads(shown.stdout)
    match = re.fullmatch(rf"manylinux_2_(\d+)_{platform.machine()}", report["sym_tag"])
    assert match and int(match.group(1)) <= 28, (report["sym_tag"], report["versioned_symbols"])
