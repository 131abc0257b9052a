"""How ops are found: JIT from an empty cache, cache keys, killed builds, pre-built wheels."""

import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from conftest import REPO_ROOT

from deepspeed_cpp.ops.op_builder import ALL_OPS, CPUAdamBuilder, builder
from deepspeed_cpp.ops.op_builder.build_info import (
    current_build_info,
    mismatch,
    stable_abi_local_version,
    wheel_local_version,
)
from deepspeed_cpp.ops.op_builder.builder import STABLE_ABI_MIN_TORCH

STEP_SCRIPT = """
import torch
from deepspeed_cpp.ops import cpu_adam_step
p, g, m, v = torch.ones(9), torch.ones(9), torch.zeros(9), torch.zeros(9)
cpu_adam_step(p, g, m, v, step=1, lr=0.5)
assert torch.allclose(p, torch.full((9,), 0.5)), p
print("STEP OK")
"""


def _run(code, env_overrides, cwd=None, timeout=600):
    env = dict(os.environ, **env_overrides)
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def _cache_files(cache: Path, name: str, folder: str = "*") -> list[Path]:
    """Files under `cache` named like `name` in a folder named like `folder` (fnmatch). Unlike
    Path.rglob it does not raise when a folder vanishes mid-walk: a waiting process may be
    clearing a dead build's folder while the test looks."""
    return [
        Path(parent, file)
        for parent, _, files in os.walk(cache)  # os.walk skips folders it can no longer list
        if fnmatch.fnmatch(Path(parent).name, folder)
        for file in fnmatch.filter(files, name)
    ]


def _cpu_adam_builder(cache: Path) -> int | None:
    """The pid in cpu_adam's lock file while a build of it runs with its compiler started."""
    locks = _cache_files(cache, "cpu_adam_*.lock")
    if not locks or not _cache_files(cache, "build.ninja", folder="cpu_adam_*"):
        return None
    try:
        owner = locks[0].read_text().split()
    except FileNotFoundError:  # the build ended between the walk and the read
        return None
    return int(owner[1]) if owner[:1] == ["building"] and len(owner) > 1 else None


def test_jit_by_three_processes_at_once_survives_the_builder_being_killed(tmp_path):
    """Three processes start together on an empty cache: one takes each op's build lock, the
    others wait on its flock. The one compiling cpu_adam is killed mid-compile (its whole process
    group, compiler included). Of the two left, one finds the dead build's lock, clears it and
    compiles from scratch; the other waits on that build and loads the finished library without
    compiling (no second compile, no half-built library). A fourth process then finds the
    library in the cache and compiles nothing. (One cold build serves both the concurrent-start
    and the killed-build checks: a cpu_adam compile is the slowest step of this file.)"""
    env = dict(os.environ, DS_CPP_EXTENSIONS_DIR=str(tmp_path))
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", STEP_SCRIPT],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )  # fmt: skip
        for _ in range(3)
    ]
    try:
        deadline = time.monotonic() + 300
        while (victim_pid := _cpu_adam_builder(tmp_path)) is None:
            assert time.monotonic() < deadline, "the JIT build of cpu_adam never started"
            assert all(run.poll() is None for run in runs), "a build finished before the kill"
            time.sleep(0.05)
        (victim,) = [run for run in runs if run.pid == victim_pid]
        time.sleep(1.0)
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait()
        half_built = _cache_files(tmp_path, "cpu_adam_*.so", folder="cpu_adam_*")
        assert not half_built, f"the build was not killed: {half_built}"
        survivors = [run for run in runs if run is not victim]
        outputs = [run.communicate(timeout=600) for run in survivors]
    finally:
        for run in runs:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.wait()
    for run, (out, err) in zip(survivors, outputs):
        assert run.returncode == 0, err[-3000:]
        assert "STEP OK" in out
    errs = [err for _, err in outputs]
    compiled = [err.count("compiling op 'cpu_adam' just in time") for err in errs]
    assert sorted(compiled) == [0, 1], (compiled, errs)
    cleared = [err for err in errs if "cleared a stale build lock" in err]
    assert len(cleared) == 1 and f"pid {victim.pid}" in cleared[0], errs
    assert len(_cache_files(tmp_path, "cpu_adam_*.so")) == 1
    cached = _run(STEP_SCRIPT, {"DS_CPP_EXTENSIONS_DIR": str(tmp_path)})
    assert cached.returncode == 0, cached.stderr
    assert "STEP OK" in cached.stdout
    assert "just in time" not in cached.stderr


def test_cache_key_follows_sources_flags_and_nothing_else(tmp_path, monkeypatch):
    import shutil

    copy = tmp_path / "csrc"
    shutil.copytree(builder.csrc_dir(), copy)
    monkeypatch.setattr(builder, "csrc_dir", lambda: copy)
    op = CPUAdamBuilder()
    original = op.source_digest()
    assert op.source_digest() == original
    (copy / "README.md").write_text("documentation is not a build input\n")
    assert op.source_digest() == original
    header = copy / "common" / "adam_math.h"
    header.write_text(header.read_text() + "\n// changed\n")
    after_header = op.source_digest()
    assert after_header != original
    source = copy / "cpu_adam" / "cpu_adam_kernel.cpp"
    source.write_text(source.read_text() + "\n// changed\n")
    after_source = op.source_digest()
    assert after_source != after_header
    monkeypatch.setattr(CPUAdamBuilder, "extra_cflags", lambda self: ["-O2"])
    assert op.source_digest() != after_source


LOAD_REGISTRY = """
import deepspeed_cpp
from deepspeed_cpp.ops.op_builder import RegistryBuilder
op = RegistryBuilder()
op.load()
print("PACKAGE", deepspeed_cpp.__file__)
print("LOADED", op.loaded_library())
"""


def test_two_checkouts_of_the_same_sources_share_one_build(tmp_path):
    """The cache key names no path: a second checkout (or venv) of the same sources loads the
    first one's finished build without compiling, and the first then still loads it without
    compiling (no turn-taking over one folder). Each process imports its own checkout; that an
    edited source or header builds afresh is the test above."""
    from session_builds import copy_tracked_tree

    cache = tmp_path / "cache"
    checkouts = [copy_tracked_tree(tmp_path / name) for name in ("a", "b")]

    def load(checkout: Path) -> tuple[str, bool]:
        env = {"DS_CPP_EXTENSIONS_DIR": str(cache), "PYTHONPATH": str(checkout)}
        ran = _run(LOAD_REGISTRY, env, cwd=tmp_path)
        assert ran.returncode == 0, ran.stderr[-3000:]
        assert f"PACKAGE {checkout / 'deepspeed_cpp'}" in ran.stdout, ran.stdout
        library = ran.stdout.split("LOADED ")[1].strip()
        return library, "compiling op 'registry' just in time" in ran.stderr

    first, compiled_first = load(checkouts[0])
    assert compiled_first and first.startswith(str(cache))
    assert load(checkouts[1]) == (first, False)
    assert load(checkouts[0]) == (first, False)


def _pip(*args, env_overrides, cwd=REPO_ROOT):
    env = dict(os.environ, **env_overrides)
    return subprocess.run([sys.executable, "-m", "pip", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=900)  # fmt: skip


def test_invalid_build_flag_fails_the_install(tmp_path):
    result = _pip("wheel", "--no-build-isolation", "--no-deps", "-w", str(tmp_path), ".",
                  env_overrides={"DS_BUILD_CPU_ADAM": "yes"})  # fmt: skip
    assert result.returncode != 0
    assert "DS_BUILD_CPU_ADAM='yes' is not valid; use 1 or 0" in result.stdout + result.stderr


def _setup_py(*args, env_overrides, cwd=REPO_ROOT, timeout=120):
    env = dict(os.environ, **env_overrides)
    return subprocess.run([sys.executable, "setup.py", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def test_deepspeed_only_flags_say_what_stands_in():
    result = _setup_py("--version", env_overrides={"DS_BUILD_UTILS": "1", "DS_BUILD_GDS": "0"})
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("deepspeed_cpp")]
    assert lines == [
        "deepspeed_cpp setup: DS_BUILD_GDS ignored: no GPUDirect Storage; NVMe offload uses the "
        "aio op (DS_BUILD_AIO)",
        "deepspeed_cpp setup: DS_BUILD_UTILS ignored: flatten/unflatten are part of the zero op "
        "(DS_BUILD_ZERO)",
    ]


@pytest.mark.parametrize(
    ("flag", "hint"),
    [("DS_BUILD_CPU_ADMA", "did you mean DS_BUILD_CPU_ADAM? "), ("DS_BUILD_WARP_DRIVE", "")],
)
def test_unknown_build_flag_stops_the_build(flag, hint):
    result = _setup_py("--version", env_overrides={flag: "1"})
    assert result.returncode != 0
    assert f"unknown flag {flag}; {hint}known op flags: DS_BUILD_AIO," in result.stderr


def test_zero_overrides_build_all(tmp_path):
    every_op_off = {f"DS_BUILD_{name.upper()}": "0" for name in ALL_OPS}
    result = _pip("wheel", "--no-build-isolation", "--no-deps", "-w", str(tmp_path), ".",
                  env_overrides={"DS_BUILD_OPS": "1", **every_op_off})  # fmt: skip
    assert result.returncode == 0, result.stderr
    (wheel,) = tmp_path.glob("deepspeed_cpp-*.whl")
    assert wheel.name.endswith("py3-none-any.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.endswith(".so")]
    assert "deepspeed_cpp/csrc/cpu_adam/cpu_adam_kernel.cpp" in names


@pytest.fixture(scope="module")
def prebuilt_site(prebuilt_cpu_adam_wheel, tmp_path_factory):
    """The shared cpu_adam wheel (conftest.py), installed into a folder of its own. Both its
    libraries use the stable ABI, so the wheel is abi3 and names the oldest torch it serves."""
    wheel = prebuilt_cpu_adam_wheel
    local = stable_abi_local_version(STABLE_ABI_MIN_TORCH)  # torchabi2.13
    assert wheel.name.startswith(f"deepspeed_cpp-0.1.0+{local}-cp311-abi3-linux_"), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert "deepspeed_cpp/_ops/cpu_adam.abi3.so" in names, names
    assert "deepspeed_cpp/_ops/build_info.json" in names
    assert "deepspeed_cpp/csrc/registration.cpp" in names
    site = tmp_path_factory.mktemp("prebuilt_site") / "site"
    installed = _pip("install", "--no-deps", "--target", str(site), str(wheel), env_overrides={})
    assert installed.returncode == 0, installed.stderr
    return site


def _no_compiler(site, tmp_path):
    return {
        "PYTHONPATH": str(site),
        "CXX": str(tmp_path / "no-such-compiler"),
        "DS_CPP_EXTENSIONS_DIR": str(tmp_path / "empty-cache"),
    }


def test_parallel_build_ext_links_each_op_from_its_own_objects(prebuilt_site, tmp_path):
    # Both libraries load and run with no compiler at hand: each was linked from its own objects.
    ran = _run(STEP_SCRIPT, _no_compiler(prebuilt_site, tmp_path), cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert "STEP OK" in ran.stdout and "just in time" not in ran.stderr


def test_prebuilt_wheel_needs_no_compiler(prebuilt_site, tmp_path):
    no_compiler = _no_compiler(prebuilt_site, tmp_path)
    site = str(prebuilt_site)
    code = STEP_SCRIPT + (
        "import deepspeed_cpp\n"
        f"assert deepspeed_cpp.__file__.startswith({site!r}), deepspeed_cpp.__file__\n"
    )
    ran = _run(code, no_compiler, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert "just in time" not in ran.stderr
    assert not (tmp_path / "empty-cache").exists()
    report = _run("from deepspeed_cpp.env_report import main; main()", no_compiler, cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    assert re.search(
        r"cpu_adam +: pre-built \(cpu_adam\.abi3\.so, stable ABI: any torch >= 2\.13\)",
        report.stdout,
    ), report.stdout
    assert "cpu isa level:" in report.stdout


def test_wheel_records_what_it_was_built_against(prebuilt_site):
    info = json.loads((prebuilt_site / "deepspeed_cpp" / "_ops" / "build_info.json").read_text())
    assert info == {
        **current_build_info(),
        "ops": ["registry", "cpu_adam"],
        "stable_abi_ops": ["registry", "cpu_adam"],
        "stable_abi_min_torch": "2.13",
    }
    assert (prebuilt_site / "deepspeed_cpp-0.1.0+torchabi2.13.dist-info").is_dir()


def test_only_libraries_on_the_regular_abi_need_the_same_torch():
    """A record like the shared wheel's, plus the zero op (regular C++ ABI): under another torch
    the stable-ABI libraries stay usable, the zero op is refused naming both versions."""
    running = {**current_build_info(), "torch_version": "2.14.1+cu130", "cuda_version": "13.0"}
    recorded = {
        **running,
        "torch_version": "2.13.0+cpu",
        "cuda_version": None,
        "stable_abi_ops": ["registry", "cpu_adam"],
        "stable_abi_min_torch": "2.13",
    }
    assert mismatch(recorded, running, op="cpu_adam") == ""
    assert mismatch(recorded, running, op="zero") == (
        "built for torch 2.13.0+cpu, running torch 2.14.1+cu130; built for CUDA None, "
        "running CUDA 13.0"
    )
    older = {**running, "torch_version": "2.12.1+cpu"}
    assert mismatch(recorded, older, op="registry") == (
        "built for torch >= 2.13 (stable ABI), running torch 2.12.1+cpu"
    )
    other_machine = {**recorded, "machine": "aarch64" if running["machine"] != "aarch64" else "x"}
    assert mismatch(other_machine, running, op="cpu_adam").startswith("built for CPU architecture ")


def _site_copy(prebuilt_site, tmp_path, folder="site", **recorded):
    """A copy of the installed wheel, its build record changed to `recorded`."""
    site = tmp_path / folder
    shutil.copytree(prebuilt_site, site, ignore=shutil.ignore_patterns("__pycache__"))
    record = site / "deepspeed_cpp" / "_ops" / "build_info.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), **recorded}))
    return site


# Where the copy's JIT builds of the two ops go (the folder names digest where csrc/ is).
_JIT_DIRS = """
from deepspeed_cpp.ops.op_builder import CPUAdamBuilder, RegistryBuilder
for op in (RegistryBuilder(), CPUAdamBuilder()):
    print(op.NAME, op.jit_build_dir())
"""


def test_prebuilt_for_another_torch_falls_back_to_jit_or_names_both_versions(
    prebuilt_site, tmp_path
):
    import torch

    # Built with another torch and CUDA: the stable-ABI libraries load all the same, no compiler.
    other = "2.13.0+cpu"
    built_elsewhere = _site_copy(
        prebuilt_site, tmp_path, "elsewhere", torch_version=other, cuda_version=None
    )
    env = _no_compiler(built_elsewhere, tmp_path)
    loaded = _run(STEP_SCRIPT + _LOADED_FROM, env, cwd=tmp_path)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    prebuilt = built_elsewhere / "deepspeed_cpp" / "_ops" / "cpu_adam.abi3.so"
    assert f"LOADED FROM {prebuilt}" in loaded.stdout
    assert "just in time" not in loaded.stderr

    # Targeting a torch newer than the running one: refused, naming both versions.
    newer = "2.99"
    site = _site_copy(prebuilt_site, tmp_path, stable_abi_min_torch=newer)
    env = _no_compiler(site, tmp_path)
    refused = _run(STEP_SCRIPT, env, cwd=tmp_path)
    assert refused.returncode == 1, refused.stderr[-3000:]
    assert (
        f"built for torch >= {newer} (stable ABI), running torch {torch.__version__}; and it "
        f"cannot be compiled just in time for torch {torch.__version__} here: no C++ compiler"
        in refused.stderr
    )
    assert f"a wheel whose version ends in +{wheel_local_version(current_build_info())}" in (
        refused.stderr
    )

    # With a finished JIT build of the same sources in the cache (the wheel's own libraries put
    # where a compiler would have written them), the stale libraries are passed over for it.
    dirs = _run(_JIT_DIRS, env, cwd=tmp_path)
    assert dirs.returncode == 0, dirs.stderr
    for line in dirs.stdout.splitlines():
        name, build_dir = line.split(" ", 1)
        build_dir = Path(build_dir)
        build_dir.mkdir(parents=True)
        (library,) = (site / "deepspeed_cpp" / "_ops").glob(f"{name}.*so")
        shutil.copy(library, build_dir / f"{build_dir.name}.so")
        build_dir.with_name(build_dir.name + ".lock").write_text("")
    fallback = _run(STEP_SCRIPT + _LOADED_FROM, env, cwd=tmp_path)
    assert fallback.returncode == 0, fallback.stderr[-3000:]
    assert f"LOADED FROM {env['DS_CPP_EXTENSIONS_DIR']}" in fallback.stdout
    assert f"cannot be used: built for torch >= {newer}" in fallback.stderr
    assert "using a just-in-time build instead" in fallback.stderr
    report = _run("from deepspeed_cpp.env_report import main; main()", env, cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    line = next(
        ln.strip() for ln in report.stdout.splitlines() if ln.strip().startswith("cpu_adam ")
    )
    assert f"pre-built library unusable (the pre-built {site}" in line, line
    assert line.endswith("compiled in the JIT cache"), line


_LOADED_FROM = """
from deepspeed_cpp.ops.op_builder import CPUAdamBuilder
print("LOADED FROM", CPUAdamBuilder().loaded_library())
"""


def test_truncated_prebuilt_library_is_named_with_the_fix(prebuilt_site, tmp_path):
    site = _site_copy(prebuilt_site, tmp_path)
    (library,) = (site / "deepspeed_cpp" / "_ops").glob("cpu_adam.*so")
    library.write_bytes(library.read_bytes()[:4096])
    ran = _run(STEP_SCRIPT, _no_compiler(site, tmp_path), cwd=tmp_path)
    assert ran.returncode == 1, ran.stderr[-3000:]  # not -7 (SIGBUS)
    assert f"{library} is not a loadable shared library: it is truncated (4096 bytes" in ran.stderr
    assert "To fix it: reinstall deepspeed_cpp (pip install --force-reinstall" in ran.stderr


def test_no_compiler_and_nothing_prebuilt_says_why(tmp_path):
    env = {"CXX": str(tmp_path / "no-such-compiler"), "DS_CPP_EXTENSIONS_DIR": str(tmp_path)}
    result = _run(STEP_SCRIPT, env)
    assert result.returncode != 0
    assert "is not pre-built for this torch and cannot be compiled just in time" in result.stderr
    assert "no-such-compiler' is not on PATH" in result.stderr


def test_report_lists_every_op():
    result = _run("from deepspeed_cpp.env_report import main; main(['--load'])", {})
    assert result.returncode == 0, result.stderr
    assert re.search(r"cpu_adam +:", result.stdout), result.stdout
    assert "cpu isa level: " in result.stdout
