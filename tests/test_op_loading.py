"""How ops are found: JIT from an empty cache, cache keys, killed builds, pre-built wheels."""

import os
import re
import signal
import subprocess
import sys
import time
import zipfile

import pytest
from conftest import REPO_ROOT

from deepspeed_cpp.ops.op_builder import ALL_OPS, CPUAdamBuilder, builder

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


def test_jit_from_empty_cache_then_cached(tmp_path):
    env = {"DS_CPP_EXTENSIONS_DIR": str(tmp_path)}
    first = _run(STEP_SCRIPT, env)
    assert first.returncode == 0, first.stderr
    assert "STEP OK" in first.stdout
    assert "compiling op 'cpu_adam' just in time" in first.stderr
    assert list(tmp_path.rglob("cpu_adam_*.so")), "no library in the JIT cache"
    second = _run(STEP_SCRIPT, env)
    assert second.returncode == 0, second.stderr
    assert "just in time" not in second.stderr


def test_two_processes_building_the_same_op_at_once(tmp_path):
    """Both start on an empty cache together: one compiles, the other waits on the build's
    flock, then loads the finished library (no second compile, no half-built library)."""
    env = dict(os.environ, DS_CPP_EXTENSIONS_DIR=str(tmp_path))
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", STEP_SCRIPT],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        for _ in range(2)
    ]
    outputs = [run.communicate(timeout=600) for run in runs]
    for run, (out, err) in zip(runs, outputs):
        assert run.returncode == 0, err
        assert "STEP OK" in out
    compiled = [err.count("compiling op 'cpu_adam' just in time") for _, err in outputs]
    assert sorted(compiled) == [0, 1], compiled
    assert len(list(tmp_path.rglob("cpu_adam_*.so"))) == 1


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


def test_build_killed_mid_compile_does_not_block_the_next(tmp_path):
    env = {"DS_CPP_EXTENSIONS_DIR": str(tmp_path)}
    victim = subprocess.Popen(
        [sys.executable, "-c", STEP_SCRIPT], env=dict(os.environ, **env),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    # Wait until the compiler is running on the op's sources, then kill the whole build.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        locks = list(tmp_path.rglob("cpu_adam_*.lock"))
        if (
            locks
            and locks[0].read_text().startswith("building")
            and list(tmp_path.rglob("cpu_adam_*/build.ninja"))
        ):
            break
        assert victim.poll() is None, "the build finished before it could be killed"
        time.sleep(0.05)
    else:
        pytest.fail("the JIT build of cpu_adam never started")
    time.sleep(1.0)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    assert not list(tmp_path.rglob("cpu_adam_*/cpu_adam_*.so")), "the build was not interrupted"

    after = _run(STEP_SCRIPT, env, timeout=300)
    assert after.returncode == 0, after.stderr
    assert "STEP OK" in after.stdout
    assert "cleared a stale build lock" in after.stderr
    assert f"pid {victim.pid}" in after.stderr


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


def test_parallel_build_ext_links_each_op_from_its_own_objects(tmp_path):
    # `setup.py build_ext -jN` used to build extensions concurrently into one build folder,
    # where torch's build.ninja files overwrite each other (ld: cannot find .../cpu_isa.o).
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO_ROOT, capture_output=True, text=True, check=True)  # fmt: skip
    source = tmp_path / "source"
    for name in files.stdout.splitlines():
        if (REPO_ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            (source / name).write_bytes((REPO_ROOT / name).read_bytes())
    env = {"DS_BUILD_ZERO": "1"}  # with the registry: two extensions, built with -j2 at once
    built = _setup_py("build_ext", "-j2", "bdist_wheel", "-d", str(tmp_path / "dist"),
                      env_overrides=env, cwd=source, timeout=900)  # fmt: skip
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("deepspeed_cpp-*.whl")
    libraries = sorted(n.split("/")[-1].split(".")[0] for n in zipfile.ZipFile(wheel).namelist()
                       if n.startswith("deepspeed_cpp/_ops/") and n.endswith(".so"))  # fmt: skip
    assert libraries == ["registry", "zero"]
    site = tmp_path / "site"
    installed = _pip("install", "--no-deps", "--target", str(site), str(wheel), env_overrides={})
    assert installed.returncode == 0, installed.stderr
    code = (
        "import torch\n"
        "from deepspeed_cpp.ops.zero import flatten_into\n"
        "parts = [torch.randn(3, 5), torch.randn(7)]\n"
        "flat = torch.zeros(22)\n"
        "flatten_into(parts, flat, [0, 15])\n"
        "assert torch.equal(flat, torch.cat([parts[0].flatten(), parts[1]])), flat\n"
        "print('LOADED OK')\n"
    )
    no_compiler = {
        "PYTHONPATH": str(site),
        "CXX": str(tmp_path / "no-such-compiler"),
        "DS_CPP_EXTENSIONS_DIR": str(tmp_path / "empty-cache"),
    }
    ran = _run(code, no_compiler, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert "LOADED OK" in ran.stdout and "just in time" not in ran.stderr


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


def test_prebuilt_wheel_needs_no_compiler(tmp_path):
    wheels = tmp_path / "wheels"
    result = _pip("wheel", "--no-build-isolation", "--no-deps", "-w", str(wheels), ".",
                  env_overrides={"DS_BUILD_OPS": "1", "DS_BUILD_FUSED_ADAM": "0",
                                 "DS_BUILD_MOE_CUDA": "0", "MAX_JOBS": "2"})  # fmt: skip
    # (the CUDA ops' nvcc builds take minutes; their own tests build them)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (wheel,) = wheels.glob("deepspeed_cpp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "deepspeed_cpp/_ops/build_info.json" in names
    assert any(n.startswith("deepspeed_cpp/_ops/cpu_adam.") and n.endswith(".so") for n in names)
    assert "deepspeed_cpp/csrc/registration.cpp" in names

    site = tmp_path / "site"
    installed = _pip("install", "--no-deps", "--target", str(site), str(wheel), env_overrides={})
    assert installed.returncode == 0, installed.stderr
    no_compiler = {
        "PYTHONPATH": str(site),
        "CXX": str(tmp_path / "no-such-compiler"),
        "DS_CPP_EXTENSIONS_DIR": str(tmp_path / "empty-cache"),
    }
    code = STEP_SCRIPT + (
        "import deepspeed_cpp\n"
        f"assert deepspeed_cpp.__file__.startswith({str(site)!r}), deepspeed_cpp.__file__\n"
    )
    ran = _run(code, no_compiler, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert "just in time" not in ran.stderr
    assert not (tmp_path / "empty-cache").exists()
    report = _run("from deepspeed_cpp.env_report import main; main()", no_compiler, cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    assert re.search(r"cpu_adam +: pre-built", report.stdout), report.stdout
    assert "cpu isa level:" in report.stdout


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
