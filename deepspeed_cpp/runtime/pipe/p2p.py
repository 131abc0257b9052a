"""Point-to-point exchange of activations and their gradients between neighbouring stages.

A message is a tensor or a tuple of tensors. Its description (tuple or not; per tensor dtype and
shape) travels once, on the first message of a channel, and is reused after: every later message
is only the tensors' data, received into fresh buffers of the known shapes. ``dynamic_shape``
sends the description with every message (sequence lengths that vary per batch).

Sends are non-blocking and the tensors they read are kept alive until ``wait_sends()``; receives
block, named so that a neighbour that died surfaces as ``CollectiveTimeoutError`` naming it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...comm.collective_errors import named_collective

_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}


def _describe(message) -> list[int]:
    tensors = message if isinstance(message, tuple) else (message,)
    words = [1 if isinstance(message, tuple) else 0, len(tensors)]
    for index, tensor in enumerate(tensors):
        if not torch.is_tensor(tensor):
            raise TypeError(
                f"a pipeline stage can only pass tensors or tuples of tensors to the next; "
                f"item {index} is {type(tensor).__name__}"
            )
        if tensor.dtype not in _CODE:
            raise TypeError(f"a pipeline activation of dtype {tensor.dtype} cannot be sent")
        words += [_CODE[tensor.dtype], tensor.dim(), *tensor.shape]
    return words


def _parse(words: list[int]) -> tuple[bool, list[tuple[torch.dtype, list[int]]]]:
    is_tuple, count, position, specs = bool(words[0]), words[1], 2, []
    for _ in range(count):
        dtype, ndim = _DTYPES[words[position]], words[position + 1]
        specs.append((dtype, words[position + 2 : position + 2 + ndim]))
        position += 2 + ndim
    return is_tuple, specs


class Channel:
    """Messages from this rank to ``peer`` (or from ``peer`` to this rank) of one kind."""

    def __init__(self, peer: int, what: str, *, dynamic_shape: bool = False):
        self.peer = peer
        self.what = what
        self.dynamic_shape = dynamic_shape
        self._specs = None  # (is_tuple, [(dtype, shape)]) once known
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def send(self, message) -> None:
        tensors = message if isinstance(message, tuple) else (message,)
        if self._specs is None or self.dynamic_shape:
            words = torch.tensor(_describe(message), dtype=torch.int64)
            length = torch.tensor([words.numel()], dtype=torch.int64)
            self._isend(length)
            self._isend(words)
            self._specs = _parse(words.tolist())
        for tensor in tensors:
            self._isend(tensor.detach().contiguous())

    def _isend(self, tensor: torch.Tensor) -> None:
        self._pending.append((dist.isend(tensor, dst=self.peer), tensor))

    def recv(self, device: torch.device):
        if self._specs is None or self.dynamic_shape:
            length = torch.empty(1, dtype=torch.int64)
            self._recv(length, "the message description")
            words = torch.empty(int(length.item()), dtype=torch.int64)
            self._recv(words, "the message description")
            self._specs = _parse(words.tolist())
        is_tuple, specs = self._specs
        tensors = []
        for index, (dtype, shape) in enumerate(specs):
            tensor = torch.empty(shape, dtype=dtype, device=device)
            self._recv(tensor, f"tensor {index} of shape {shape}")
            tensors.append(tensor)
        return tuple(tensors) if is_tuple else tensors[0]

    def _recv(self, tensor: torch.Tensor, part: str) -> None:
        with named_collective(lambda: f"receive of {self.what} ({part}) from rank {self.peer}"):
            dist.recv(tensor, src=self.peer)

    def drop_sends(self) -> None:
        self._pending.clear()

    def wait_sends(self) -> None:
        for work, _ in self._pending:
            with named_collective(lambda: f"send of {self.what} to rank {self.peer}"):
                work.wait()
        self._pending.clear()
