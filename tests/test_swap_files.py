"""Swap files of NVMe offload (SwapFolder) on real files through the real aio handle: round trips,
independent completion, header checks, crash safety, stale folders, full disks, and the ``aio``
config section (file size limits: test_swap_file_size_limit.py).

Covering design: the round trip runs on every engine the machine has; the other tests use the
default engine. "A transfer in flight" is made long on purpose with 4096-byte pieces one at a time
(16 MiB take about half a second here, a 40-byte read a millisecond). What needs a dead process,
interpreter exit or a small file system (a mount namespace) runs in a subprocess.
"""

import errno
import gc
import json
import logging
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from disk_folders import mount_namespace_prefix, o_direct_works
from swap_helpers import assert_names, random_payload, run_python

from deepspeed_cpp.ops.aio import usable_engines
from deepspeed_cpp.runtime.config import AioConfig, DeepSpeedConfig, DeepSpeedConfigError
from deepspeed_cpp.runtime.zero.offload import (
    AioSettings,
    StaleSwapFileError,
    SwapFileError,
    SwapFolder,
    SwapTicket,
    remove_stale_folders,
    stale_swap_folders,
    swap_errors,
    swap_header,
)

HEADER = swap_header.HEADER_BYTES
ENGINES = usable_engines()
SLOW = AioSettings(block_size=4096, queue_depth=1)  # a 16 MiB write stays in flight a while
SLOW_BYTES = 16 << 20


pytestmark = pytest.mark.usefixtures("aio_library")  # compiled before any subprocess needs it


@pytest.fixture
def ds_info_log(caplog):
    """Captures the 'deepspeed_cpp' logger, which does not propagate to the root logger."""
    logger = logging.getLogger("deepspeed_cpp")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="deepspeed_cpp")
    yield caplog
    logger.removeHandler(caplog.handler)


def _raw(tensor):
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


def _header_of(path):
    with open(path, "rb") as file:
        return swap_header.decode_header(file.read(HEADER))


def _patch(path, offset, data):
    with open(path, "r+b") as file:
        file.seek(offset)
        file.write(data)


def _swap_root(nvme):
    return nvme / stale_swap_folders.ROOT_NAME


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_round_trip_of_odd_sizes_and_dtypes_many_in_flight(engine, nvme):
    folder = SwapFolder(
        nvme, purpose="optimizer", rank=3, aio=AioSettings(engine=engine), max_in_flight=3
    )
    assert folder.folder.parent == _swap_root(nvme)
    sizes = [1, 4097, 3 * 2**20 + 3]
    data = {
        f"group{i}/{str(dtype)[6:]}": random_payload(n, dtype)
        for i, (dtype, n) in enumerate(
            (dtype, n) for dtype in (torch.float32, torch.bfloat16, torch.uint8) for n in sizes
        )
    }
    tickets = [folder.write(key, tensor) for key, tensor in data.items()]  # 9 writes, 3 slots
    assert all(isinstance(t, SwapTicket) for t in tickets)
    folder.wait_all()
    assert all(t.done() for t in tickets)
    for ticket in tickets:
        ticket.wait()  # done: returns at once, again and again
        ticket.wait()
    assert sorted(folder.keys()) == sorted(data) and all(map(folder.has, data))
    expected_size = sum(HEADER + t.numel() * t.element_size() for t in data.values())
    assert folder.bytes_on_disk() == expected_size
    # The files as plain Python reads them: a header, then exactly the tensor's bytes.
    for key, tensor in data.items():
        path = folder.path_of(key)
        assert path.parent == folder.folder and path.stat().st_size == HEADER + len(_raw(tensor))
        assert path.read_bytes()[HEADER:] == _raw(tensor)
        header = _header_of(path)
        assert header.complete and header.key == key and header.run_id == folder.run_id
    backs = {key: torch.empty_like(tensor) for key, tensor in data.items()}
    read_tickets = [folder.read(key, backs[key]) for key in data]
    for ticket in read_tickets:
        ticket.wait()
    for key, tensor in data.items():
        assert _raw(backs[key]) == _raw(tensor), key
    # Large transfers went through O_DIRECT where the file system has it.
    stats = [slot.handle.get_stats() for slot in folder._state.slots]
    assert len(stats) <= 3
    if o_direct_works(nvme):
        assert sum(s["direct_bytes"] for s in stats) >= 2 * 4 * (3 * 2**20)
    # Rewrite: new data, new dtype and a smaller size under an existing key; another bigger.
    key_a, key_b = "group0/float32", "group2/float32"
    new_a, new_b = random_payload(4097, torch.bfloat16), random_payload(5 * 2**20 + 1, torch.uint8)
    folder.write(key_a, new_a)
    folder.write(key_b, new_b).wait()
    back_a, back_b = torch.empty_like(new_a), torch.empty_like(new_b)
    folder.read(key_a, back_a).wait()  # waits for its own key's write first
    folder.read(key_b, back_b).wait()
    assert _raw(back_a) == _raw(new_a) and _raw(back_b) == _raw(new_b)
    assert folder.path_of(key_a).stat().st_size == HEADER + len(_raw(new_a))
    with pytest.raises(StaleSwapFileError, match="holds 4097 x bfloat16"):
        folder.read(key_a, torch.empty(1, dtype=torch.float32))
    folder.close()


def test_empty_tensor_odd_keys_and_remove(nvme):
    with SwapFolder(nvme, purpose="param", rank=0) as folder:
        odd_keys = ["a/b", "..", ".hidden", "ä ü %2F", "x" * 500]
        for i, key in enumerate(odd_keys):
            folder.write(key, torch.full((3,), float(i))).wait()
        assert len({folder.path_of(key) for key in odd_keys}) == len(odd_keys)
        for i, key in enumerate(odd_keys):
            back = torch.empty(3)
            folder.read(key, back).wait()
            assert torch.equal(back, torch.full((3,), float(i)))
            assert folder.path_of(key).parent == folder.folder
        empty = folder.write("empty", torch.empty(0, 4))
        assert empty.done()
        folder.read("empty", torch.empty(0, 4)).wait()
        folder.remove("a/b")
        folder.remove("never written")
        assert not folder.has("a/b") and not folder.path_of("a/b").exists()
        with pytest.raises(SwapFileError, match="never written, removed") as error:
            folder.read("a/b", torch.empty(3))
        assert error.value.errno == errno.ENOENT
        with pytest.raises(ValueError, match="must be contiguous"):
            folder.write("t", torch.zeros(4, 2).t())
        with pytest.raises(ValueError, match="key must be a non-empty str"):
            folder.write("", torch.zeros(1))
    assert folder.closed


# --- tickets complete independently -------------------------------------------------------------


def test_a_read_does_not_wait_for_a_write_of_another_key(nvme):
    folder = SwapFolder(nvme, purpose="optimizer", rank=0, aio=SLOW, max_in_flight=2)
    small = torch.arange(10.0)
    folder.write("small", small).wait()
    big = torch.randint(0, 256, (SLOW_BYTES,), dtype=torch.uint8)
    write = folder.write("big", big)
    back = torch.empty_like(small)
    read = folder.read("small", back)
    read.wait()
    assert not write.done(), "the read waited for the unrelated write"
    assert torch.equal(back, small) and read.done()
    write.wait()
    assert write.done()
    folder.close()
    # One slot: the read has to wait for the write's handle, so the write is done first.
    folder = SwapFolder(nvme, purpose="optimizer", rank=0, aio=SLOW, max_in_flight=1)
    folder.write("small", small).wait()
    write = folder.write("big", big)
    read = folder.read("small", back)
    assert write.done()
    read.wait()
    folder.close()


def test_wait_all_reports_a_failure_once_and_keeps_going(nvme):
    folder = SwapFolder(nvme, purpose="optimizer", rank=0, aio=SLOW)
    ok = folder.write("ok", torch.ones(100))
    big = folder.write("doomed", torch.zeros(SLOW_BYTES, dtype=torch.uint8))
    shutil.rmtree(folder.folder)  # the folder vanishes while the write is in flight
    with pytest.raises(SwapFileError) as error:
        folder.wait_all()
    assert_names(str(error.value), "'doomed'", f"{SLOW_BYTES} bytes", str(folder.folder))
    assert big.done() and ok.done()
    folder.wait_all()  # reported once
    with pytest.raises(SwapFileError):
        big.wait()  # a ticket keeps raising its failure
    assert not folder.has("doomed")
    folder.close()


# --- header checks ------------------------------------------------------------------------------


def test_header_mismatches_are_stale_files_named_with_what_differs(nvme):
    folder = SwapFolder(nvme, purpose="optimizer", rank=0)
    data = torch.randn(4097)
    folder.write("state", data).wait()
    path = folder.path_of("state")

    def stale(into, *parts):
        with pytest.raises(StaleSwapFileError) as error:
            folder.read("state", into)
        assert_names(str(error.value), f"'{path}'", "'state'", *parts)
        assert isinstance(error.value, SwapFileError) and isinstance(error.value, OSError)

    stale(torch.empty(4098), "holds 4097 x float32", "4098 x float32")
    stale(torch.empty(4097, dtype=torch.int32), "holds 4097 x float32", "4097 x int32")
    good = path.read_bytes()
    _patch(path, 200, b"\xff")  # inside the header (the key area): the checksum catches it
    stale(torch.empty(4097), "corrupted")
    path.write_bytes(good[:-1])  # one byte of data missing
    stale(torch.empty(4097), f"has {len(good) - 1} bytes", f"expected {len(good)}")
    path.write_bytes(b"\0" * len(good))
    stale(torch.empty(4097), "no swap-file header")
    path.write_bytes(good)
    back = torch.empty(4097)
    folder.read("state", back).wait()
    assert torch.equal(back, data)
    # The same key of another run (another folder, this process) copied in over ours.
    other = SwapFolder(nvme, purpose="optimizer", rank=0)
    assert other.run_id != folder.run_id and other.folder != folder.folder
    other.write("state", torch.randn(4097)).wait()
    shutil.copyfile(other.path_of("state"), path)
    stale(torch.empty(4097), f"written by run '{other.run_id}'", f"this run is '{folder.run_id}'")
    # Another run's file under a key this folder never wrote: never read either.
    shutil.copyfile(other.path_of("state"), folder.path_of("not mine"))
    with pytest.raises(StaleSwapFileError, match=f"written by run '{other.run_id}'"):
        folder.read("not mine", torch.empty(4097))
    # An older write of this key (same run) put back: the generation tells.
    folder.write("state", data).wait()
    older = folder.path_of("state").read_bytes()
    folder.write("state", data).wait()
    folder.path_of("state").write_bytes(older)
    stale(torch.empty(4097), "holds write #")
    other.close()
    folder.close()


def test_header_is_invalid_while_a_write_is_in_flight(nvme):
    folder = SwapFolder(nvme, purpose="param", rank=0, aio=SLOW)
    folder.write("shard", torch.ones(SLOW_BYTES, dtype=torch.uint8)).wait()
    assert _header_of(folder.path_of("shard")).complete
    ticket = folder.write("shard", torch.zeros(SLOW_BYTES, dtype=torch.uint8))
    assert not ticket.done()
    header = _header_of(folder.path_of("shard"))
    assert header.key == "shard" and not header.complete  # invalid before the data changes
    ticket.wait()
    assert _header_of(folder.path_of("shard")).complete
    folder.close()


# --- crash safety and stale folders -------------------------------------------------------------

_KILLED_SCRIPT = """
import json, os, signal, sys, torch
from deepspeed_cpp.runtime.zero.offload import AioSettings, SwapFolder
nvme, how = sys.argv[1], sys.argv[2]
folder = SwapFolder(nvme, purpose="optimizer", rank=1,
                    aio=AioSettings(block_size=4096, queue_depth=1))
folder.write("done", torch.ones(5000)).wait()
ticket = folder.write("half", torch.ones(16 << 20, dtype=torch.uint8))
print(json.dumps({"folder": str(folder.folder), "in_flight": not ticket.done(),
                  "path": str(folder.path_of("half"))}), flush=True)
if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
os._exit(0)  # leaves without close() and without atexit
"""


@pytest.mark.parametrize("how", ["kill", "exit_without_cleanup"])
def test_dead_runs_folder_is_removed_by_the_next_run_and_never_read(how, nvme, ds_info_log):
    result, out = run_python(_KILLED_SCRIPT, nvme, how, check=False, timeout=120)
    assert result.returncode == (-signal.SIGKILL if how == "kill" else 0), result.stderr
    dead = Path(out["folder"])
    assert dead.is_dir() and (dead / swap_header.file_name("done")).is_file()
    assert out["in_flight"]  # it died mid-write: that file does not read as valid
    assert not _header_of(out["path"]).complete
    # Things a new run must not touch: a live process's folder, another host's, foreign names.
    alive = SwapFolder(nvme, purpose="optimizer", rank=0)
    root = _swap_root(nvme)
    other_host = root / f"optimizer-otherhost-pid999999-rank0-{'a' * 16}"
    foreign = [
        root / "notes",
        root / f"optimizer-{stale_swap_folders.host_name()}-pid999999-rank0-xyz",
    ]
    for path in (other_host, *foreign):
        path.mkdir()
    (root / "readme.txt").write_text("keep")
    fresh = SwapFolder(nvme, purpose="optimizer", rank=1)
    assert not dead.exists()
    removals = [r.getMessage() for r in ds_info_log.records if "removed stale swap folder" in r.msg]
    assert len(removals) == 1 and str(dead) in removals[0] and "is gone" in removals[0], removals
    assert all(p.is_dir() for p in (alive.folder, other_host, *foreign))
    assert (root / "readme.txt").read_text() == "keep"
    with pytest.raises(SwapFileError, match="never written"):
        fresh.read("done", torch.empty(5000))
    fresh.close()
    alive.close()


def test_old_versions_folder_whose_pid_was_reused_counts_as_dead(nvme, ds_info_log):
    folder = SwapFolder(nvme, purpose="optimizer", rank=0)
    folder.write("x", torch.ones(3)).wait()
    owner = json.loads((folder.folder / "owner").read_text())
    assert owner["pid"] == os.getpid() and owner["start_time"] is not None
    assert owner["liveness"] == "flock"
    # A folder of a version that never locked its owner file (no "liveness"): judged by pid.
    # Our own pid, but its owner started at another time: that process is gone.
    old = folder.folder.with_name(folder.folder.name[:-16] + "b" * 16)
    old.mkdir()
    old_owner = {"pid": owner["pid"], "start_time": 1, "host": owner["host"]}
    (old / "owner").write_text(json.dumps(old_owner))
    (old / "x.swp").write_bytes(b"\0" * 4096)
    (old / "stray.bin").write_text("not ours")  # kept, with the folder
    # An old version's folder of this live process (right start time) stays.
    alive = old.with_name(old.name[:-16] + "a" * 16)
    alive.mkdir()
    (alive / "owner").write_text(json.dumps(dict(old_owner, start_time=owner["start_time"])))
    assert remove_stale_folders(nvme) == [old]
    assert sorted(os.listdir(old)) == ["stray.bin"]
    assert any("not made by deepspeed_cpp" in r.getMessage() for r in ds_info_log.records)
    assert (alive / "owner").is_file()
    assert sorted(os.listdir(folder.folder)) == ["owner", "x.swp"]  # its lock is held: live
    folder.close()
    shutil.rmtree(alive)


def test_close_removes_everything_and_is_idempotent(nvme):
    folder = SwapFolder(nvme, purpose="param", rank=2)
    name = folder.folder.name
    assert name.startswith(f"param-{stale_swap_folders.host_name()}-pid{os.getpid()}-rank2-")
    assert name.endswith(folder.run_id) and len(folder.run_id) == 16
    for i in range(5):
        folder.write(f"k{i}", torch.randn(1000 * i + 1))
    folder.close()
    assert not folder.folder.exists() and _swap_root(nvme).is_dir()
    folder.close()
    with pytest.raises(ValueError, match="is closed"):
        folder.write("k", torch.ones(1))
    # Dropped without close(): the garbage collector's finalizer removes it.
    dropped = SwapFolder(nvme, purpose="param", rank=2)
    dropped.write("k", torch.ones(10)).wait()
    path = dropped.folder
    del dropped
    gc.collect()
    assert not path.exists()


_EXIT_SCRIPT = """
import json, os, sys, torch
from deepspeed_cpp.runtime.zero.offload import SwapFolder
folder = SwapFolder(sys.argv[1], purpose="optimizer", rank=0)
folder.write("a", torch.ones(1 << 20))  # still in flight, maybe, at exit
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a forked child's exit must leave the parent's folder alone
os.waitpid(pid, 0)
print(json.dumps({"folder": str(folder.folder), "after_fork": folder.folder.is_dir()}))
"""


def test_interpreter_exit_without_close_removes_the_folder(nvme):
    _, out = run_python(_EXIT_SCRIPT, nvme, timeout=120)
    assert out["after_fork"]
    assert not Path(out["folder"]).exists()
    assert os.listdir(_swap_root(nvme)) == []


# --- errors -------------------------------------------------------------------------------------

_FULL_DISK_SCRIPT = """
import json, os, subprocess, sys, torch
from deepspeed_cpp.runtime.zero.offload import SwapFileError, SwapFolder
small_fs, read_only = sys.argv[1], sys.argv[2]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", small_fs], check=True)
subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", read_only], check=True)
out = {}
folder = SwapFolder(small_fs, purpose="optimizer", rank=0)
big = torch.randint(0, 256, (2 << 20,), dtype=torch.uint8)
before = big.clone()
ticket = folder.write("big", big)
try:
    ticket.wait()
    out["error"] = "no error"
except SwapFileError as error:
    out["error"], out["errno"], out["nbytes"] = str(error), error.errno, error.nbytes
out["untouched"] = bool(torch.equal(big, before))
out["has"] = folder.has("big")
out["file_left"] = folder.path_of("big").exists()
small = torch.randn(1000)  # the space came back: the folder goes on working
folder.write("small", small).wait()
back = torch.empty_like(small)
folder.read("small", back).wait()
out["small_ok"] = bool(torch.equal(back, small))
try:
    folder.read("big", torch.empty_like(big))
except SwapFileError as error:
    out["read_error"] = str(error)
folder.close()
try:
    SwapFolder(read_only, purpose="optimizer", rank=0)
except SwapFileError as error:
    out["read_only"] = str(error)
print(json.dumps(out))
"""


def test_full_disk_is_a_swap_file_error_naming_path_bytes_and_enospc(tmp_path):
    prefix = mount_namespace_prefix(tmp_path)
    if prefix is None:
        pytest.skip("no mount namespace here to make a small file system")
    (tmp_path / "small_fs").mkdir()
    (tmp_path / "read_only").mkdir()
    _, out = run_python(
        _FULL_DISK_SCRIPT, tmp_path / "small_fs", tmp_path / "read_only", prefix=prefix, timeout=120
    )
    assert_names(
        out["error"],
        "'big'",
        "2097152 bytes",
        str(tmp_path / "small_fs"),
        "big.swp",
        "ENOSPC (28): No space left on device",
    )
    assert out["errno"] == errno.ENOSPC and out["nbytes"] == 2 << 20
    assert out["untouched"] and not out["has"] and not out["file_left"] and out["small_ok"]
    assert_names(out["read_error"], "'big'", "never written, removed, or its last write failed")
    assert_names(out["read_only"], str(tmp_path / "read_only"), "EROFS (30)")


def test_missing_or_vanished_paths_are_named(nvme, tmp_path):
    missing = tmp_path / "no" / "such" / "nvme"
    with pytest.raises(SwapFileError) as error:
        SwapFolder(missing, purpose="optimizer", rank=0)
    assert_names(str(error.value), f"'{missing}'", "ENOENT (2): No such file or directory")
    assert error.value.errno == errno.ENOENT and error.value.filename == str(missing)
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    with pytest.raises(SwapFileError, match="ENOTDIR"):
        SwapFolder(a_file, purpose="optimizer", rank=0)
    folder = SwapFolder(nvme, purpose="optimizer", rank=0)
    shutil.rmtree(nvme)  # the whole nvme_path goes away under a live folder
    with pytest.raises(SwapFileError) as error:
        folder.write("k", torch.ones(7))
    assert_names(str(error.value), "'k'", "28 bytes", str(folder.folder), "ENOENT (2)")
    folder.close()  # nothing left to delete: no error
    with pytest.raises(ValueError, match="purpose"):
        SwapFolder(tmp_path, purpose="bad/purpose", rank=0)


def test_swap_file_error_survives_pickling():
    import pickle

    error = StaleSwapFileError("it", errno=errno.ESTALE, path="/x", nbytes=5)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is StaleSwapFileError and str(again) == "it"
    assert (again.errno, again.filename, again.nbytes) == (errno.ESTALE, "/x", 5)
    assert swap_errors.errno_text(errno.ENOSPC) == "ENOSPC (28): No space left on device"


# --- the aio config section ---------------------------------------------------------------------


def test_aio_settings_from_config_defaults_and_values():
    defaults = AioSettings()
    assert (
        defaults.block_size,
        defaults.queue_depth,
        defaults.intra_op_parallelism,
        defaults.single_submit,
        defaults.overlap_events,
    ) == (1 << 20, 8, 1, False, True)
    assert AioSettings.from_config(None) == defaults
    assert AioSettings.from_config(DeepSpeedConfig.parse({"train_batch_size": 1}).aio) == defaults
    config = DeepSpeedConfig.parse(
        {
            "train_batch_size": 1,
            "aio": {
                "block_size": 262144,
                "queue_depth": 32,
                "thread_count": 4,
                "single_submit": True,
                "overlap_events": False,
                "use_gds": False,
            },
        }
    )
    assert isinstance(config.aio, AioConfig)
    assert config.aio.thread_count == config.aio.intra_op_parallelism == 4
    settings = AioSettings.from_config(config.aio)
    assert settings == AioSettings(262144, 32, 4, True, False)
    assert AioSettings.from_config({"intra_op_parallelism": 2}).intra_op_parallelism == 2
    same = {"thread_count": 3, "intra_op_parallelism": 3}
    assert AioSettings.from_config(same).intra_op_parallelism == 3
    handle = settings.new_handle()  # the settings reach the handle
    assert (
        handle.get_block_size(),
        handle.get_queue_depth(),
        handle.get_intra_op_parallelism(),
        handle.get_single_submit(),
        handle.get_overlap_events(),
    ) == (262144, 32, 4, True, False)


def test_aio_config_section_without_warnings(ds_info_log):
    DeepSpeedConfig.load({"train_batch_size": 2, "aio": {"queue_depth": 4}})
    assert not [r for r in ds_info_log.records if "aio" in r.getMessage()]


@pytest.mark.parametrize(
    "aio_section, expected",
    [
        ({"use_gds": True}, "aio.use_gds = true: GPUDirect Storage (GDS) is not supported"),
        (
            {"blok_size": 4096},
            "unknown key 'aio.blok_size' (value 4096): did you mean 'aio.block_size'?",
        ),
        (
            {"thread_count": 2, "intra_op_parallelism": 4},
            "aio.thread_count = 2 and aio.intra_op_parallelism = 4 differ",
        ),
        ({"block_size": 1000}, "aio.block_size = 1000: expected a positive multiple of 4096"),
        ({"queue_depth": 0}, "aio.queue_depth = 0: expected an integer in [1, 4096]"),
        ({"overlap_events": "yes"}, 'aio.overlap_events = "yes": expected true or false'),
    ],
)
def test_bad_aio_sections_are_named(aio_section, expected):
    with pytest.raises(DeepSpeedConfigError) as error:
        DeepSpeedConfig.parse({"train_batch_size": 1, "aio": aio_section})
    assert expected in str(error.value)
    with pytest.raises(DeepSpeedConfigError) as error:
        AioSettings.from_config(aio_section)
    assert expected in str(error.value)
    if "use_gds" in aio_section:
        assert "expected false" in str(error.value)
