"""NVMe swap writes under a file size limit (RLIMIT_FSIZE), on real files through the real aio
handle: the error names the path, the bytes and errno, and nothing of the training state is
lost (tests/test_swap_files.py holds the other swap-file tests)."""

import contextlib
import errno
import resource
import signal

import pytest
import torch
from swap_helpers import assert_names, random_payload

from deepspeed_cpp.runtime.zero.offload import SwapFileError, SwapFolder

pytestmark = pytest.mark.usefixtures("aio_library")  # compiled before any subprocess needs it


@contextlib.contextmanager
def _file_size_limit(limit):
    """RLIMIT_FSIZE for this process (Python ignores SIGXFSZ, so a write past it fails with
    EFBIG instead of killing the process), lifted again however the body ends."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_file_size_limit_is_a_swap_file_error_and_the_state_survives(nvme):
    """RLIMIT_FSIZE below a swap file: a new key fails when its file is sized, a key rewritten
    in place when its data is written; both name the path, the bytes and EFBIG, leave the tensor
    and the other keys as they were, and the same write succeeds once the limit is lifted."""
    assert signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN
    folder = SwapFolder(nvme, purpose="optimizer", rank=0)
    nbytes = 2 << 20
    kept, grown, rewritten = (random_payload(nbytes, torch.uint8) for _ in range(3))
    folder.write("kept", kept).wait()
    folder.write("rewritten", torch.zeros(nbytes, dtype=torch.uint8)).wait()
    snapshot = [t.clone() for t in (kept, grown, rewritten)]
    with _file_size_limit((1 << 20) + 12345):
        with pytest.raises(SwapFileError) as new_key:
            folder.write("grown", grown)  # sizing the new file fails at once
        ticket = folder.write("rewritten", rewritten)  # same size: the data write fails
        with pytest.raises(SwapFileError) as in_place:
            ticket.wait()
    for error, key in ((new_key.value, "grown"), (in_place.value, "rewritten")):
        assert_names(str(error), f"{key!r}", f"{nbytes} bytes", str(folder.path_of(key)),
                     "EFBIG (27): File too large")  # fmt: skip
        assert error.errno == errno.EFBIG and error.nbytes == nbytes, str(error)
        assert not folder.has(key)
        with pytest.raises(SwapFileError, match="write did not complete|last write failed"):
            folder.read(key, torch.empty_like(kept))  # never taken for complete data
    assert all(torch.equal(a, b) for a, b in zip((kept, grown, rewritten), snapshot))
    back = torch.empty_like(kept)
    folder.read("kept", back).wait()
    assert torch.equal(back, kept)  # another key, written before, reads back whole
    for key, tensor in (("grown", grown), ("rewritten", rewritten)):
        folder.write(key, tensor).wait()  # the limit lifted: the same writes go through
        back = torch.empty_like(tensor)
        folder.read(key, back).wait()
        assert torch.equal(back, tensor), key
    folder.close()
