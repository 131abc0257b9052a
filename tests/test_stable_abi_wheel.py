"""One wheel across torch versions: the shared stable-ABI wheel (conftest.py), built under this
torch, installed into a fresh venv with torch 2.13.0 (the CPU build), where cpu_adam must load
pre-built, match torch's AdamW and the float64 reference, and a ZeRO-2 step must train on 2 gloo
ranks. The zero op holds c10d process groups and custom classes, which have no stable-ABI form:
it stays on the regular ABI and is compiled just in time for 2.13.0 there.

torch 2.13.0 comes from the wheel cache scripts/setup_env.sh fills (.cache/other-torch) or from
pip's configured indexes; when neither has it the test fails saying so, it never skips.

torch 2.13.0 does not depend on this checkout: it is unpacked once per machine (about 10 s) into
~/.cache/deepspeed_cpp/other-torch and reused; the venv, the wheel, its install and the zero op's
JIT build for 2.13.0 are new on every run, made in the session's background
(tests/session_builds.py) while other tests run.
"""

import re
import sys
import zipfile
from pathlib import Path

import pytest
import session_builds
from conftest import REPO_ROOT
from session_builds import OTHER_TORCH, tool_path
from session_builds import run as _run

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


@pytest.fixture(scope="module")
def other_torch_venv(tmp_path_factory):
    """(python, site-packages, JIT cache) of the venv with torch 2.13.0 and the wheel installed
    (tests/session_builds.py: built in the session's background or now)."""
    built = session_builds.other_torch_venv(tmp_path_factory.mktemp("other_torch"))
    if "error" in built:
        pytest.fail(built["error"])
    return Path(built["python"]), Path(built["site"]), Path(built["jit"])


def test_wheel_loads_prebuilt_under_torch_2_13_without_a_compiler(other_torch_venv, tmp_path):
    python, theirs, _jit = other_torch_venv
    ran = _run(
        [python, "-c", PREBUILT_CHECK, theirs, OTHER_TORCH],
        cwd=tmp_path,
        CXX=str(tmp_path / "no-such-compiler"),
        DS_CPP_EXTENSIONS_DIR=str(tmp_path / "empty-cache"),
        PATH=tool_path(python),
    )
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert f"PREBUILT OK {OTHER_TORCH}" in ran.stdout
    assert "just in time" not in ran.stderr
    assert not (tmp_path / "empty-cache").exists()


def test_cpu_adam_and_a_zero2_step_pass_under_torch_2_13(other_torch_venv, tmp_path):
    python, _site, jit = other_torch_venv
    tests = [REPO_ROOT / "tests" / name for name in SMOKE_TESTS]
    ran = _run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        cwd=tmp_path,
        # The zero op, compiled for 2.13.0 there while the venv was made (or now, if that failed).
        DS_CPP_EXTENSIONS_DIR=str(jit),
        DS_TEST_PREBUILD="0",  # conftest's background builds would compile the source tree's ops
        PATH=tool_path(python),
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
