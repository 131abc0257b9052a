"""Every documented way of building the package, run on a clean copy of the tracked files.

Nothing is pre-built here (no DS_BUILD_* flag), so each path only packages Python files and the
C++ sources: seconds, not minutes. What each must produce is the same: a wheel (or an install)
with csrc/ inside, from which ``import deepspeed_cpp`` works and finds its sources for JIT
builds. The pre-built paths (DS_BUILD_OPS=1, ``setup.py build_ext -jN bdist_wheel``) are in
test_op_loading.py.
"""

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from session_builds import copy_tracked_tree

# Files every install must carry: the schemas, a shared CPU-optimizer source, a family header.
REQUIRED_SOURCES = [
    "deepspeed_cpp/csrc/registration.cpp",
    "deepspeed_cpp/csrc/cpu_optim/cpu_optim_avx2.cpp",
    "deepspeed_cpp/csrc/cpu_adam/cpu_optim_family.h",
]

# Imports the installed package from `site` alone and checks where its sources are.
IMPORT_CHECK = """
import sys
import deepspeed_cpp
from deepspeed_cpp.ops.op_builder.builder import csrc_dir
site = sys.argv[1]
assert deepspeed_cpp.__file__.startswith(site), deepspeed_cpp.__file__
assert str(csrc_dir()).startswith(site), csrc_dir()
print("IMPORT OK", deepspeed_cpp.__version__)
"""


def _clean_env(**overrides) -> dict[str, str]:
    # No DS_BUILD_* from the caller's shell: these paths must build nothing.
    env = {k: v for k, v in os.environ.items() if not k.startswith("DS_BUILD_")}
    env.pop("PYTHONPATH", None)
    env.update(overrides)
    return env


def _run(args, cwd, timeout=300, **env):
    return subprocess.run(args, cwd=cwd, env=_clean_env(**env), capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return copy_tracked_tree(tmp_path_factory.mktemp("clean") / "source")


def _check_wheel(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    missing = [n for n in REQUIRED_SOURCES if n not in names]
    assert not missing, f"{wheel.name} lacks {missing}"
    assert not [n for n in names if n.endswith((".so", ".o"))], "nothing should be compiled"


def _install_and_import(wheel, tmp_path):
    site = tmp_path / "site"
    installed = _run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site),
                      str(wheel)], cwd=tmp_path)  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    _import_from(site, tmp_path)


def _import_from(site, cwd):
    ran = _run([sys.executable, "-c", IMPORT_CHECK, str(site)], cwd=cwd, PYTHONPATH=str(site))
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "IMPORT OK" in ran.stdout


def test_pip_install_target_non_editable(source, tmp_path):
    site = tmp_path / "site"
    result = _run([sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
                   "--target", str(site), str(source)], cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for name in REQUIRED_SOURCES:
        assert (site / name).is_file(), name
    _import_from(site, tmp_path)


def test_pip_wheel(source, tmp_path):
    result = _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                   "-w", str(tmp_path / "dist"), str(source)], cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("deepspeed_cpp-*.whl")
    assert wheel.name.endswith("py3-none-any.whl"), wheel.name
    _check_wheel(wheel)
    _install_and_import(wheel, tmp_path)


def test_python_m_build_wheel(source, tmp_path):
    # `build` is a tool, not a dependency: scripts/setup_env.sh installs it into the venv.
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}  # where `build` may have come from
    probe = _run([sys.executable, "-m", "build", "--version"], cwd=tmp_path, **env)
    if probe.returncode != 0:
        pytest.skip("`build` is not installed (pip install build; scripts/setup_env.sh does)")
    result = _run([sys.executable, "-m", "build", "--no-isolation", "--wheel", "--outdir",
                   str(tmp_path / "dist"), str(source)], cwd=tmp_path, **env)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("deepspeed_cpp-*.whl")
    _check_wheel(wheel)
    _install_and_import(wheel, tmp_path)


def test_config_settings_reach_bdist_wheel(source, tmp_path):
    # pip >= 23.3 has no --build-option/--global-option; options for setup.py's commands go
    # through PEP 517 config settings, which setuptools' backend hands to bdist_wheel as
    # `--build-option` (split on spaces). A build tag shows it arrived: deepspeed_cpp-0.1.0-7-...
    result = _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                   "--config-settings=--build-option=--build-number=7",
                   "-w", str(tmp_path / "dist"), str(source)], cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("deepspeed_cpp-*.whl")
    assert wheel.name.startswith("deepspeed_cpp-0.1.0-7-"), wheel.name
    _check_wheel(wheel)


def _fresh_venv_seeing_ours(tmp_path):
    """A new virtual environment whose own site-packages is empty but which sees this one's
    packages (torch, setuptools, pip) through a .pth line: an install into it cannot touch ours,
    and it downloads nothing. Only the new site-packages is a site directory, so the editable
    finders already installed here are not run there."""
    venv = tmp_path / "venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    ours = sysconfig.get_paths()["purelib"]
    theirs = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                  cwd=tmp_path).stdout.strip()  # fmt: skip
    Path(theirs, "our_packages.pth").write_text(ours + "\n")
    return python


EDITED_CHECK = """
import sys
import deepspeed_cpp
from deepspeed_cpp.ops.op_builder.builder import csrc_dir
source = sys.argv[1]
assert deepspeed_cpp.__file__.startswith(source), deepspeed_cpp.__file__
assert str(csrc_dir()) == source + "/csrc", csrc_dir()
from deepspeed_cpp import _editable_probe  # written after the install: seen only if editable
print("EDITABLE OK", _editable_probe.VALUE)
"""


def test_pip_install_editable(source, tmp_path):
    python = _fresh_venv_seeing_ours(tmp_path)
    result = _run([str(python), "-m", "pip", "install", "--no-build-isolation", "--no-deps",
                   "--no-index", "-e", str(source)], cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    probe = source / "deepspeed_cpp" / "_editable_probe.py"
    probe.write_text("VALUE = 7\n")
    try:
        ran = _run([str(python), "-c", EDITED_CHECK, str(source.resolve())], cwd=tmp_path)
    finally:
        probe.unlink()
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "EDITABLE OK 7" in ran.stdout
