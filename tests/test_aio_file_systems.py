"""The aio handle where the file system or the process is not the usual one: a file-size limit, a
full small file system, a read-only file, file systems that refuse O_DIRECT (a buffered fallback
with one warning) and /dev/shm. Each error names the request, the path, the offset and errno;
what needs a changed process (a limit, dropped privileges, a mount namespace) runs in a
subprocess. The handle on an ordinary disk: test_aio.py."""

import os
import shutil
import warnings

import pytest
import torch
from disk_folders import mount_namespace_prefix, o_direct_works
from swap_helpers import (
    assert_names,
    file_bytes,
    random_bytes,
    run_python_json,
    temp_folder_in,
)

from deepspeed_cpp.ops.aio import AsyncIOHandle, usable_engines

ENGINES = usable_engines()

pytestmark = pytest.mark.usefixtures("aio_library")  # compiled before any subprocess needs it


_FILE_SIZE_LIMIT_SCRIPT = """
import json, os, resource, signal, sys, warnings, torch
from deepspeed_cpp.ops.aio import AsyncIOHandle
warnings.simplefilter("error")  # no spurious "no O_DIRECT here" warning on the way
folder, engine = sys.argv[1], sys.argv[2]
handle = AsyncIOHandle(block_size=1 << 20, engine=engine)
existing = os.path.join(folder, "existing.bin")
data = torch.randint(0, 256, (2 << 20,), dtype=torch.uint8)
handle.sync_pwrite(data, existing)
# Past the limit a write fails with EFBIG instead of killing the process with SIGXFSZ.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
limit = (1 << 20) + 12345
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
errors = []
for path in (os.path.join(folder, "fresh.bin"), existing):  # allocation fails / a write fails
    try:
        handle.sync_pwrite(torch.randint(0, 256, (2 << 20,), dtype=torch.uint8), path)
        errors.append("no error")
    except RuntimeError as error:
        errors.append(str(error))
small = torch.randint(0, 256, (5000,), dtype=torch.uint8)  # the handle goes on working
handle.sync_pwrite(small, os.path.join(folder, "small.bin"))
back = torch.empty_like(small)
handle.sync_pread(back, os.path.join(folder, "small.bin"))
print(json.dumps({"errors": errors, "small_ok": bool(torch.equal(back, small))}))
"""


@pytest.mark.parametrize("engine", ENGINES)
def test_full_disk_by_file_size_limit(engine, tmp_path):
    out = run_python_json(_FILE_SIZE_LIMIT_SCRIPT, tmp_path, engine)
    fresh, existing = out["errors"]
    assert_names(fresh, "write of 2097152 bytes", "fresh.bin", "at file offset 0",
                 "File too large", "EFBIG")  # fmt: skip
    # Overwriting in place allocates nothing: the failure comes from a write past the limit.
    assert_names(existing, "write of 2097152 bytes", "existing.bin", "at file offset 0",
                 f"the {engine} pwrite of", "File too large", "EFBIG")  # fmt: skip
    assert out["small_ok"]


_FULL_TMPFS_SCRIPT = """
import json, subprocess, sys, torch
from deepspeed_cpp.ops.aio import AsyncIOHandle
folder = sys.argv[1]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", folder], check=True)
handle = AsyncIOHandle()
try:
    handle.sync_pwrite(torch.zeros(2 << 20, dtype=torch.uint8), folder + "/big.bin", 4096)
    message = "no error"
except RuntimeError as error:
    message = str(error)
print(json.dumps({"error": message}))
"""


def test_full_disk_on_a_small_file_system(tmp_path):
    prefix = mount_namespace_prefix(tmp_path)
    if prefix is None:
        pytest.skip("no mount namespace here; the full disk is covered by the file-size limit")
    (tmp_path / "small_fs").mkdir()
    out = run_python_json(_FULL_TMPFS_SCRIPT, tmp_path / "small_fs", prefix=prefix)
    assert_names(out["error"], "write of 2097152 bytes", "big.bin", "at file offset 4096",
                 "No space left on device", "ENOSPC")  # fmt: skip


_READ_ONLY_SCRIPT = """
import json, sys, torch
from deepspeed_cpp.ops.aio import AsyncIOHandle
try:
    AsyncIOHandle().sync_pwrite(torch.ones(100, dtype=torch.uint8), sys.argv[1])
    message = "no error"
except RuntimeError as error:
    message = str(error)
print(json.dumps({"error": message}))
"""


def test_read_only_file(tmp_path):
    path = tmp_path / "read_only.bin"
    path.write_bytes(b"keep")
    path.chmod(0o444)
    # root may write anything; without CAP_DAC_OVERRIDE it obeys the mode like anyone else.
    drop = ["setpriv", "--inh-caps=-dac_override,-dac_read_search",
            "--bounding-set=-dac_override,-dac_read_search"]  # fmt: skip
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot make a file read-only for us")
    out = run_python_json(_READ_ONLY_SCRIPT, path, prefix=drop if os.geteuid() == 0 else ())
    assert_names(out["error"], "write of 100 bytes", f"'{path}'", "at file offset 0",
                 "Permission denied", "EACCES")  # fmt: skip
    assert path.read_bytes() == b"keep"


# --- file systems without O_DIRECT --------------------------------------------------------------


_BUFFERED_FALLBACK_SCRIPT = """
import json, subprocess, sys, warnings, torch
from deepspeed_cpp.ops.aio import AsyncIOHandle
folder, mount = sys.argv[1], sys.argv[2] == "mount"
if mount:
    subprocess.run(["mount", "-t", "ramfs", "ramfs", folder], check=True)
handle = AsyncIOHandle(block_size=8192)
ok = True
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for i, (size, offset) in enumerate([(1, 0), (3 * 8192 + 5, 12345), (100000, 4096)]):
        data = torch.randint(0, 256, (size,), dtype=torch.uint8)
        handle.sync_pwrite(data, f"{folder}/f{i}.bin", offset)
        back = torch.empty_like(data)
        handle.sync_pread(back, f"{folder}/f{i}.bin", offset)
        with open(f"{folder}/f{i}.bin", "rb") as f:
            ok &= f.read()[offset:] == data.numpy().tobytes() and bool(torch.equal(back, data))
print(json.dumps({"ok": ok, "warnings": [str(w.message) for w in caught],
                  "stats": handle.get_stats()}))
"""


def test_buffered_fallback_with_one_warning_where_o_direct_is_refused(tmp_path):
    # tmpfs refuses O_DIRECT before Linux 6.6 and ramfs always does.
    if os.path.isdir("/dev/shm") and not o_direct_works("/dev/shm"):
        folder, prefix, mode = temp_folder_in("/dev/shm"), (), "plain"
    else:
        prefix = mount_namespace_prefix(tmp_path)
        if prefix is None:
            pytest.skip("no file system refusing O_DIRECT is reachable without privileges")
        folder, mode = tmp_path / "ramfs", "mount"
        folder.mkdir()
    try:
        out = run_python_json(_BUFFERED_FALLBACK_SCRIPT, folder, mode, prefix=prefix)
    finally:
        if mode == "plain":
            shutil.rmtree(folder, ignore_errors=True)
    assert out["ok"]
    assert len(out["warnings"]) == 1, out["warnings"]
    assert_names(out["warnings"][0], "does not support O_DIRECT", "f0.bin", "EINVAL",
                 "buffered I/O")  # fmt: skip
    assert out["stats"]["direct_bytes"] == 0
    assert out["stats"]["buffered_bytes"] == 2 * (1 + 3 * 8192 + 5 + 100000)


def test_dev_shm_round_trip():
    """Whatever /dev/shm does with O_DIRECT (refuse it, or accept and buffer it), data is kept."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    folder = temp_folder_in("/dev/shm")
    try:
        handle = AsyncIOHandle()
        data = random_bytes(3 * 2**20 + 5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            handle.sync_pwrite(data, f"{folder}/x.bin", 12345)
            back = torch.empty_like(data)
            handle.sync_pread(back, f"{folder}/x.bin", 12345)
        assert torch.equal(back, data)
        assert file_bytes(f"{folder}/x.bin", 12345) == data.numpy().tobytes()
        assert len(caught) == (0 if o_direct_works(folder) else 1)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
