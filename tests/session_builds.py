"""Builds made once per test session, by whichever asks first: tests/prebuild_ops.py in the
session's background, or the test (fixture) that needs the result. Both find the session folder
conftest.py names in DS_TEST_BACKGROUND_DIR; the first takes the build's lock and builds, the
second waits on the lock and reads the result the first wrote (JSON, renamed into place whole).
Without a session folder (DS_TEST_PREBUILD=0) the caller's fallback folder is used.

The builds: the fused Adam wheel with nvcc (tests/fused_adam_wheel_build.py), the stable-ABI
wheel with cpu_adam pre-built (``stable_abi_wheel``: test_op_loading.py, test_stable_abi_wheel.py)
and the venv with torch 2.13.0, that wheel installed and the zero op compiled for 2.13.0 in its JIT
cache (``other_torch_venv``: test_stable_abi_wheel.py). Each used to be built in the foreground
when its first test ran: ~25 s and ~35 s of a 2-core CI run spent with one core idle.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Callable
from pathlib import Path

SESSION_DIR = "DS_TEST_BACKGROUND_DIR"
REPO_ROOT = Path(__file__).resolve().parents[1]

# The stable-ABI wheel: cpu_adam and the schema library, both on PyTorch's stable C ABI, so the
# wheel is abi3 and serves every torch from 2.13 on.
PREBUILT_FLAGS = {"DS_BUILD_CPU_ADAM": "1"}
PREBUILT_LIBRARIES = ["cpu_adam", "registry"]
OTHER_TORCH = "2.13.0+cpu"
WHEEL_CACHE = Path(os.environ.get("DS_OTHER_TORCH_WHEELS", REPO_ROOT / ".cache" / "other-torch"))


def built_once(name: str, build: Callable[[Path], dict], fallback_dir: Path) -> dict:
    """``build(folder)``'s result (a JSON-able dict), built now unless the session already has
    it; ``folder`` is the session's ``name`` folder (or ``fallback_dir``)."""
    session = os.environ.get(SESSION_DIR)
    root = Path(session) / name if session else fallback_dir
    root.mkdir(parents=True, exist_ok=True)
    result_file = root / "result.json"
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # waits while the other one builds
        if not result_file.is_file():
            result = build(root)
            partial = root / "result.json.partial"
            partial.write_text(json.dumps(result))
            partial.rename(result_file)
    return json.loads(result_file.read_text())


def clean_env(**overrides) -> dict[str, str]:
    """This environment without DS_BUILD_* flags nor PYTHONPATH (the source tree must not shadow
    an installed wheel), with ``overrides``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DS_BUILD_")}
    env.pop("PYTHONPATH", None)
    env.update(overrides)
    return env


def run(args, cwd, timeout=900, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def copy_tracked_tree(destination: Path) -> Path:
    """Copies the tracked (and untracked, not ignored) files to `destination`: a clean source
    tree with no build/, no compiled library and no venv, as a fresh clone would have."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO_ROOT, capture_output=True, text=True, check=True)  # fmt: skip
    for name in files.stdout.splitlines():
        if (REPO_ROOT / name).is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            (destination / name).write_bytes((REPO_ROOT / name).read_bytes())
    return destination


def stable_abi_wheel(fallback_dir: Path) -> dict:
    """{"error"} or {"wheel"}: one wheel with cpu_adam pre-built, built with `setup.py build_ext
    -j2 bdist_wheel` from a clean copy: setuptools' -jN used to build extensions concurrently into
    one build folder, where torch's build.ninja files overwrite each other (ld: cannot find
    .../cpu_isa.o)."""
    return built_once("stable_abi_wheel", _build_stable_abi_wheel, fallback_dir)


def _build_stable_abi_wheel(root: Path) -> dict:
    source = copy_tracked_tree(root / "source")
    built = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "-j2", "bdist_wheel", "-d", str(root / "dist")],
        env=dict(os.environ, **PREBUILT_FLAGS),
        cwd=source,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if built.returncode != 0:
        return {"error": built.stdout[-3000:] + built.stderr[-3000:]}
    wheels = list((root / "dist").glob("deepspeed_cpp-*.whl"))
    if len(wheels) != 1:
        return {"error": f"expected one wheel in {root / 'dist'}, found {wheels}"}
    names = zipfile.ZipFile(wheels[0]).namelist()
    libraries = sorted(
        n.split("/")[-1].split(".")[0]
        for n in names
        if n.startswith("deepspeed_cpp/_ops/") and n.endswith(".so")
    )
    if libraries != PREBUILT_LIBRARIES:
        return {"error": f"the wheel holds libraries {libraries}, expected {PREBUILT_LIBRARIES}"}
    return {"wheel": str(wheels[0])}


def other_torch_venv(fallback_dir: Path) -> dict:
    """{"error"} or {"python", "site", "jit", "jit_log"}: a venv whose own site-packages holds the
    stable-ABI wheel, then (through .pth lines, in name order) torch 2.13.0 and after it the rest
    (numpy, pydantic, pytest, torch's pure-Python dependencies) seen from this environment:
    nothing else is downloaded or shadows torch. ``jit``: a JIT cache where the zero op (regular
    ABI: compiled for each torch) was built for 2.13.0 from the installed wheel's sources; a build
    that failed here is left to the test, which compiles again and reports the compiler's error.
    """
    return built_once("other_torch_venv", _build_other_torch_venv, fallback_dir)


def _build_other_torch_venv(root: Path) -> dict:
    wheel = stable_abi_wheel(root / "wheel")
    if "error" in wheel:
        return {"error": f"the stable-ABI wheel did not build:\n{wheel['error']}"}
    site = other_torch_site()
    if "error" in site:
        return site
    venv = root / "venv"
    made = run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=root)
    if made.returncode != 0:
        return {"error": f"python -m venv {venv} failed:\n{made.stderr}"}
    python = venv / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    theirs = Path(run([python, "-c", purelib], cwd=root).stdout.strip())
    (theirs / "a_other_torch.pth").write_text(f"{site['site']}\n")
    ours = run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", theirs,
         wheel["wheel"]],
        cwd=root,
    )  # fmt: skip
    if ours.returncode != 0:
        return {"error": f"installing the wheel into {theirs} failed:\n{ours.stderr}"}
    # Read after a_other_torch.pth: this environment's torch 2.14 comes after 2.13.0 on sys.path.
    (theirs / "our_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    jit = root / "jit"
    load_zero = "from deepspeed_cpp.ops.op_builder import ZeroBuilder; ZeroBuilder().load()"
    compiled = run(
        [python, "-c", load_zero],
        cwd=root,
        DS_CPP_EXTENSIONS_DIR=str(jit),
        PATH=tool_path(python),
    )
    return {
        "python": str(python),
        "site": str(theirs),
        "jit": str(jit),
        "jit_log": compiled.stdout[-2000:] + compiled.stderr[-2000:],
    }


def tool_path(python: Path) -> str:
    """PATH for a process of the other venv: ninja (torch's JIT builds) lives beside this
    interpreter."""
    return os.pathsep.join(
        [str(Path(python).parent), str(Path(sys.executable).parent), os.environ["PATH"]]
    )


def other_torch_site() -> dict:
    """{"site"} or {"error"}: torch 2.13.0 unpacked into a folder of its own, once per machine
    (~/.cache/deepspeed_cpp/other-torch): installed into a temporary sibling first and renamed
    into place complete, so a run that stops half-way or a second run at the same time never sees
    a partial torch. From the wheel cache scripts/setup_env.sh fills, or pip's indexes."""
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    root = Path.home() / ".cache" / "deepspeed_cpp" / "other-torch"
    site = root / f"torch-{OTHER_TORCH}-{python}"
    if (site / "torch" / "version.py").is_file():
        return {"site": str(site)}
    root.mkdir(parents=True, exist_ok=True)
    partial = root / f".partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    find_links = ["--find-links", WHEEL_CACHE] if WHEEL_CACHE.is_dir() else []
    torch_install = run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--only-binary=:all:",
         *find_links, "--target", partial, f"torch=={OTHER_TORCH}"],
        cwd=root,
    )  # fmt: skip
    if torch_install.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        return {
            "error": f"torch {OTHER_TORCH} could not be installed into {partial}, so the "
            f"stable-ABI wheel cannot be tried under another torch. Run scripts/setup_env.sh (it "
            f"downloads the wheel into {WHEEL_CACHE}) or set DS_OTHER_TORCH_WHEELS to a folder "
            f"holding torch-{OTHER_TORCH}-*.whl. pip said:\n{torch_install.stderr[-2000:]}"
        }
    try:
        partial.rename(site)
    except OSError:  # another run put its complete copy there first
        shutil.rmtree(partial, ignore_errors=True)
    return {"site": str(site)}
