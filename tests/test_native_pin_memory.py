"""``DS_PIN_MEMORY_BACKEND=native`` through the accelerator, as DeepSpeed 0.19.8 behaves with
``DS_ACCELERATOR=cpu`` (measured: ``pin_memory`` gives a page-locked copy at a new address tagged
``.ds_pinned``, of the input's shape or flat, copied or not; ``is_pinned`` is true for it and for
views into it, false for the input and for meta tensors; ``unpin_memory`` is True once, then
False, and False for memory it never pinned; without the variable ``pin_memory`` returns the
tensor itself, ``is_pinned`` is False and ``unpin_memory`` None). Ours is backed by the aio
library's locked allocations."""

from __future__ import annotations

import gc

import pytest
import torch


@pytest.fixture
def native(monkeypatch):
    import deepspeed_cpp.utils.pin_memory as pin_memory

    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "native")
    monkeypatch.setattr(pin_memory, "_shared_native_pins", None)
    return pin_memory


def test_native_backend_pins_copies_tracks_views_and_unpins(native):
    from deepspeed_cpp.accelerator import get_accelerator

    accelerator = get_accelerator()
    tensor = torch.randn(4, 8, dtype=torch.float64)
    pinned = accelerator.pin_memory(tensor)
    assert pinned.data_ptr() != tensor.data_ptr() and pinned.dtype == torch.float64
    assert torch.equal(pinned, tensor) and pinned.shape == tensor.shape
    assert pinned.ds_pinned is True and accelerator.is_pinned(pinned)
    assert pinned.data_ptr() % 4096 == 0  # page-aligned: O_DIRECT reads need no bounce buffer
    view = pinned.reshape(-1).narrow(0, 8, 8)
    assert not getattr(view, "ds_pinned", False) and accelerator.is_pinned(view)
    assert accelerator.is_pinned(pinned[3]) and not accelerator.is_pinned(tensor)
    assert not accelerator.is_pinned(torch.zeros(2, device="meta"))
    empty = accelerator.pin_memory(tensor, make_copy=False)
    assert empty.shape == tensor.shape and accelerator.is_pinned(empty)
    flat = accelerator.pin_memory(tensor, match_shape=False)
    assert flat.shape == (32,) and torch.equal(flat, tensor.reshape(-1))
    assert accelerator.unpin_memory(tensor) is False
    assert accelerator.unpin_memory(pinned) is True
    assert not accelerator.is_pinned(pinned) and not accelerator.is_pinned(view)
    assert accelerator.unpin_memory(pinned) is False
    # Unlike DeepSpeed's immediate free, the memory stays valid while a view holds it.
    assert torch.equal(view, tensor.reshape(-1)[8:16])
    # An allocation nobody unpins is forgotten when its last view goes.
    start = flat.data_ptr()
    del flat
    gc.collect()
    assert start not in native.get_native_pinned_memory()._ranges


def test_torch_backend_leaves_cpu_tensors_alone(monkeypatch):
    from deepspeed_cpp.accelerator import get_accelerator

    monkeypatch.delenv("DS_PIN_MEMORY_BACKEND", raising=False)
    accelerator = get_accelerator()
    tensor = torch.randn(3)
    assert accelerator.pin_memory(tensor) is tensor
    assert accelerator.is_pinned(tensor) is False and accelerator.unpin_memory(tensor) is None


def test_native_backend_that_cannot_load_says_so(native, monkeypatch):
    import deepspeed_cpp.ops.op_builder as op_builder

    class Failing:
        def load(self):
            raise RuntimeError("no compiler here")

    monkeypatch.setattr(op_builder, "PinMemoryBuilder", Failing)
    with pytest.raises(RuntimeError, match="pin_memory op .* cannot be loaded: no compiler here"):
        native.get_active_native_pinned_memory()
