"""The one interface between the engine (and checkpoints) and a ZeRO stage.

Every stage (0-2: ``ZeroPartitionedOptimizer``; 3: ``ZeroStage3``) implements ``ZeroStage``; the
engine and ``runtime/checkpoint`` use nothing else of it. ``PartitionLayout`` is the plain-data
description of where every trainable parameter lives in the flat fp32 master buckets, and
``LayoutPart`` places it in a process group; from these checkpoint metadata is written and
resharded (checkpoints see no stage class).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class PartitionLayout:
    """Where each trainable parameter lives: bucket ``param_bucket[i]`` at element
    ``param_offset[i]``. Rank r owns ``[r * size / world_size, (r + 1) * size / world_size)`` of
    every bucket, or (``replicated``, stage 0) every rank holds whole, identical buckets."""

    params: tuple[torch.nn.Parameter, ...]
    param_bucket: tuple[int, ...]
    param_offset: tuple[int, ...]
    bucket_sizes: tuple[int, ...]
    bucket_groups: tuple[int, ...]
    world_size: int
    replicated: bool


@dataclass(frozen=True)
class LayoutPart:
    """One set of buckets sharded over one process group, as a checkpoint records it: a stage
    has one part; the expert-parallel stage one per set (dense, then per expert group name).

    ``group_ranks``: the world rank of each rank of the part's group, in group order (its
    slices are saved in those ranks' files). ``param_group_origins[g]``: the index of the
    user's param group that the part's param group ``g`` came from. ``writes``: whether this
    rank saves its slices (at ZeRO-0 every rank of the group holds the same buckets; its first
    rank saves them). ``swapped_buckets``: the part's buckets (indices into ``layout``) whose
    optimizer state lives in NVMe swap files, read one sub-group at a time."""

    key: str
    stage: int
    layout: PartitionLayout
    group_ranks: tuple[int, ...]
    param_group_origins: tuple[int, ...]
    writes: bool
    swapped_buckets: frozenset[int]


class ZeroStage(Protocol):
    """What a ZeRO stage offers the engine. ``optimizer`` is the torch optimizer stepping this
    rank's fp32 master shards (schedulers drive it); ``param_groups`` are its groups."""

    stage: int
    world_size: int
    trains: bool  # False: a ZeRO-3 engine without an optimizer (inference)
    optimizer: torch.optim.Optimizer
    skipped_steps: int
    global_grad_norm: float | None
    overflow: bool  # the last step was skipped (fp16 overflow, NaN/inf); set by the engine

    @property
    def param_groups(self) -> list[dict]: ...

    # --- training -------------------------------------------------------------------------------
    def begin_backward(self, boundary: bool) -> None:
        """Before ``loss.backward()``; ``boundary``: this micro-step ends an accumulation."""

    def end_backward(self) -> None:
        """After ``loss.backward()``: every gradient of the micro-step has been reduced."""

    def read_local_gradients(self, active: bool) -> None:
        """Stages 0-2, inside ``engine.no_sync()``: ``safe_get_full_grad`` reads each
        parameter's locally accumulated gradient while ``active``."""

    def step(self) -> bool:
        """The optimizer step at an accumulation boundary; False when skipped (fp16 overflow,
        or a global gradient norm that is not finite: ``runtime/nonfinite_gradients.py``)."""

    def zero_grad(self) -> None: ...

    def apply_pending_update(self) -> None:
        """Finishes a delayed (DPU) optimizer step still running and writes it into the model."""

    def describe(self) -> str:
        """One line for the engine's start-up log (how gradients are reduced)."""

    # --- checkpoints ----------------------------------------------------------------------------
    def layout_parts(self) -> list[LayoutPart]:
        """What checkpoints know of the stage's layout: its parts, whose buckets follow one
        another in the order of ``owned_ranges``, ``shard_state`` and ``load_shard_state``."""

    def owned_ranges(self) -> list[tuple[int, int]]:
        """``(start, size)`` of each bucket's slice this rank owns."""

    def first_state(self) -> dict | None:
        """The first bucket's ``{"master", "state"}`` that has optimizer state (None before the
        first step)."""

    def shard_state(self) -> list[dict]:
        """Per bucket: ``{"master": fp32 slice, "state": optimizer state of that slice}``."""

    def stream_shard_state(self) -> list[dict]:
        """As ``shard_state``, with NVMe-held tensors as ``DeferredTensor`` entries read one
        sub-group at a time while the checkpoint is written."""

    def load_shard_state(self, masters: list[torch.Tensor], states: list[dict] | None) -> None:
        """Replaces the master slices (and state) and writes the parameters from them."""

    def refresh_masters_from_params(self) -> None:
        """Re-reads the master slices from the parameters (after weights were loaded)."""

    def load_module_state(self, module: torch.nn.Module, state_dict: dict) -> None:
        """Loads a whole (consolidated) module state dict (partitioned parameters keep their
        shard of each tensor)."""

    def full_state_dict(self, module: torch.nn.Module, *, rank0_only: bool) -> dict:
        """``module.state_dict()`` with every parameter whole (gathered at stage 3); with
        ``rank0_only`` the other ranks take part and get ``{}``."""

    def state_bytes(self) -> int: ...

    def destroy(self) -> None:
        """Removes every hook this stage installed on the model."""
