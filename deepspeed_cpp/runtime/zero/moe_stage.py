"""ZeRO stages 0-2 for models with expert-parallel (ep_size > 1) Mixture-of-Experts layers.

Expert parameters with ep_size > 1 differ between the ranks of an expert-parallel group: each
is a replica only within its expert-data-parallel group. So the trainable parameters are split
into sets: the dense ones (reduced and sharded over the whole data-parallel world) and one set
per expert group name (reduced and sharded over that name's expert-data-parallel group). Each
set is an ordinary ``ZeroPartitionedOptimizer`` of the engine's stage over its own group; this
composite drives them as one ``ZeroStage``:

- gradients: every set's summed gradients are divided by the data-parallel world size, expert
  ones included, as DeepSpeed's engine does ("to maintain the gradients value unaffected by
  ep_size setting"): an expert's gradient already holds the tokens of every rank of its
  expert-parallel group (they reached it by all-to-all), so summing over its expert-data-parallel
  group covers every rank once, and dividing by the world size gives the gradient of the loss
  averaged over all ranks, exactly as for the dense parameters;
- one fp16 overflow decision and one global gradient norm over all sets, from one all-reduce
  over the world in which every gradient element is counted once (replicated stage-0 sets
  count only on their group's first rank);
- one torch optimizer (the user's, re-pointed at the master shards, or the config's) stepping
  every set's masters in one ``step()``; then each set gathers its parameters over its group.

With ``offload_optimizer`` (cpu or nvme, stages 1/2) every set keeps its master shards and
optimizer state in a home of its own (``offload/optimizer_homes.py``), and the one optimizer steps
them on the host after the global clipping (``_step_offloaded_sets``). The delayed parameter update
and a partial offload (``ratio`` < 1) are refused: both run a second optimizer or a background
thread per set. ZeRO-3 with such experts is refused by the engine. Checkpoints see the sets'
buckets one after another (``owned_ranges``, ``shard_state``... concatenate them in set order);
``runtime/checkpoint/expert_layout.py`` describes them with global expert names. Whole-model
state dicts (``full_state_dict``, ``load_module_state``) name experts globally too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from ...comm.collective_errors import named_collective
from ...comm.state_broadcast import broadcast_tensor_dict
from ...moe.expert_names import expert_layers, gather_experts_to_rank0, to_local
from ...utils import groups
from .offload.optimizer_offload import OptimizerOffload
from .partitioned_optimizer import ZeroPartitionedOptimizer
from .shard_set_builder import FlatBuckets, build_zero_stage
from .stage import LayoutPart
from .stage_setup import optimizer_over_masters, set_stage_fields, trained_param_groups

DENSE = ""  # the set key of dense parameters (expert sets are keyed by their group name)


def expert_set_of(param: torch.nn.Parameter) -> str:
    """The set ``param`` belongs to: its expert group name when ep_size > 1, else ``DENSE``
    (ep_size=1 experts are replicated on every rank, like dense parameters)."""
    name = getattr(param, "group_name", None)
    if getattr(param, "allreduce", True) is not False or not isinstance(name, str):
        return DENSE
    if name == groups.expert_group_name(1):  # its groups need not exist (one process)
        return DENSE
    if groups._get_expert_data_parallel_world_size(name) == dist.get_world_size():
        return DENSE
    return name


def needs_expert_sets(params) -> bool:
    return any(expert_set_of(p) != DENSE for p in params if p.requires_grad)


class _Collect:
    """Stands in for the optimizer while a set is built: it only records the master groups, so
    that one real optimizer can be made over every set's masters afterwards."""

    # The sets' offload checks run against the real optimizer once it exists (``__init__``).
    steps_tensors_independently = True

    def __init__(self, param_groups: list[dict]):
        self.param_groups = param_groups
        self.state: dict = {}


def build_expert_parallel_stage(
    optimizer: torch.optim.Optimizer | Callable[[list[dict]], torch.optim.Optimizer],
    param_groups: list[dict] | None = None,
    *,
    stage: int,
    group: dist.ProcessGroup,
    reduce_bucket_size: int,
    gradient_clipping: float = 0.0,
    loss_scaler=None,
    reduce_scatter: bool = True,
    offload: OptimizerOffload | None = None,
) -> ExpertParallelZeroStage:
    """The ``ExpertParallelZeroStage`` over ``optimizer``'s (or ``param_groups``') trainable
    parameters: one set per expert group name and one for the dense parameters, each built by
    the builder of every stage (``shard_set_builder.build_zero_stage``) over its own group, and
    one torch optimizer over every set's masters, its groups in the user's order."""
    offload = _checked_offload_options(offload)
    param_groups = trained_param_groups(optimizer, param_groups)
    world_size = dist.get_world_size(group)
    # Per set: the part of each user group in it, and which user group each part came from.
    split: dict[str, tuple[list[dict], list[int]]] = {}
    for index, param_group in enumerate(param_groups):
        by_set: dict[str, list[torch.nn.Parameter]] = {}
        for param in param_group["params"]:
            if param.requires_grad:
                by_set.setdefault(expert_set_of(param), []).append(param)
        options = {k: v for k, v in param_group.items() if k != "params"}
        for key, params in by_set.items():
            parts, origins = split.setdefault(key, ([], []))
            parts.append({**options, "params": params})
            origins.append(index)
    # Sets are built (their reducers are collective) in the same order on every rank.
    keys = sorted(split)
    sets = [
        build_zero_stage(
            _Collect,
            split[key][0],
            layout=FlatBuckets(),
            stage=stage,
            group=group if key == DENSE else groups._get_expert_data_parallel_group(key),
            reduce_bucket_size=reduce_bucket_size,
            reduce_scatter=reduce_scatter,
            grad_divisor=world_size,
            offload=offload,
        )
        for key in keys
    ]
    # One optimizer over every set's masters, its groups in the user's order.
    masters_of: list[list[torch.nn.Parameter]] = [[] for _ in param_groups]
    for key, member in zip(keys, sets):
        for origin, master_group in zip(split[key][1], member.optimizer.param_groups):
            masters_of[origin].extend(master_group["params"])
    optimizer = optimizer_over_masters(
        optimizer,
        [
            {**{k: v for k, v in g.items() if k != "params"}, "params": masters}
            for g, masters in zip(param_groups, masters_of)
        ],
    )
    for member in sets:
        member.use_optimizer(optimizer, offload)
    return ExpertParallelZeroStage(
        sets,
        keys,
        [split[key][1] for key in keys],
        optimizer,
        stage=stage,
        group=group,
        gradient_clipping=gradient_clipping,
        loss_scaler=loss_scaler,
        offloaded=offload is not None,
    )


class ExpertParallelZeroStage:
    """``ZeroStage`` over a dense set and one set per expert group (see the module docstring),
    built by ``build_expert_parallel_stage``."""

    trains = True

    def __init__(
        self,
        sets: list[ZeroPartitionedOptimizer],
        keys: list[str],
        origins: list[list[int]],
        optimizer: torch.optim.Optimizer,
        *,
        stage: int,
        group: dist.ProcessGroup,
        gradient_clipping: float,
        loss_scaler,
        offloaded: bool,
    ):
        """``sets[i]``: the set of ``keys[i]`` (``DENSE`` or an expert group name), whose param
        groups came from the user's groups ``origins[i]`` (checkpoints record those);
        ``optimizer`` steps every set's masters."""
        set_stage_fields(
            self,
            stage=stage,
            group=group,
            gradient_clipping=gradient_clipping,
            loss_scaler=loss_scaler,
        )
        self.sets, self.keys, self.origins = sets, keys, origins
        self.optimizer = optimizer
        self.offloaded = offloaded

    # --- training -------------------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def begin_backward(self, boundary: bool) -> None:
        for member in self.sets:
            member.begin_backward(boundary)

    def end_backward(self) -> None:
        for member in self.sets:  # same order on every rank: each finishes its collectives
            member.end_backward()

    def read_local_gradients(self, active: bool) -> None:
        for member in self.sets:
            member.read_local_gradients(active)

    def step(self) -> bool:
        """Overflow check, unscale, clip by the global norm, one optimizer step, gathers; False
        when skipped (an fp16 overflow, or a global gradient norm that is not finite)."""
        grads = [grad for member in self.sets for grad in member.step_gradients()]
        device = grads[0].device
        overflow = torch.zeros((), dtype=torch.float64, device=device)
        squares = torch.zeros((), dtype=torch.float64, device=device)
        for member in self.sets:
            # A stage-0 set is replicated over its group: its first rank speaks for it.
            if member.stage == 0 and member.rank != 0:
                continue
            for grad in member.shard_grads:
                if self.loss_scaler is not None:
                    overflow += (~torch.isfinite(grad)).any().double()
            norms = torch._foreach_norm(member.shard_grads)
            squares += torch.stack(norms).double().pow(2).sum()
        totals = torch.stack([overflow, squares])
        if self.world_size > 1:
            with named_collective("all_reduce of the overflow flag and gradient norm (MoE step)"):
                dist.all_reduce(totals, group=self.group)
        if self.loss_scaler is not None and totals[0].item() > 0:
            self.loss_scaler.update_scale(True)
            self.skipped_steps += 1
            self.zero_grad()
            return False
        scale = self.loss_scaler.loss_scale if self.loss_scaler is not None else 1.0
        self.global_grad_norm = math.sqrt(float(totals[1].item())) / scale
        if not math.isfinite(self.global_grad_norm):  # runtime/nonfinite_gradients.py
            if self.loss_scaler is not None:
                self.loss_scaler.update_scale(True)
            self.skipped_steps += 1
            self.zero_grad()
            return False
        factor = 1.0 / scale
        if self.gradient_clipping > 0.0:
            coefficient = self.gradient_clipping / (self.global_grad_norm + 1e-6)
            if coefficient < 1.0:
                factor *= coefficient
        if factor != 1.0:
            torch._foreach_mul_(grads, factor)
        if self.offloaded:
            self._step_offloaded_sets()
        else:
            self.optimizer.step()
            for member in self.sets:
                member.gather_params()
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(False)
        self.zero_grad()
        return True

    def _step_offloaded_sets(self) -> None:
        """The host step of every set's (already unscaled and clipped) shard gradients, then
        each set's gathers over its group, the sets in the same order on every rank."""
        if all(member.stepper.step_per_bucket for member in self.sets):
            # Our CPU optimizers step every master on its own and skip those without a
            # gradient, so each set can step its sub-groups in turn with the one optimizer
            # (NVMe brings each in); only the set's own masters hold gradients meanwhile.
            for member in self.sets:
                member.stepper.step_on_host()
            return
        # Other optimizers (a user's may count steps per group) step once over every set's
        # masters, all resident in host memory (NVMe is refused for them).
        for member in self.sets:
            member.stepper.hand_host_grads_to_masters()
        try:
            self.optimizer.step()
        finally:
            for member in self.sets:
                member.stepper.drop_master_grads()
        for member in self.sets:
            member.stepper.gather_params_from_host()

    def zero_grad(self) -> None:
        for member in self.sets:
            member.zero_grad()

    def apply_pending_update(self) -> None:
        pass  # no delayed updates: they are refused with expert-parallel MoE

    def discard_pending_update(self) -> None:
        pass

    def describe(self) -> str:
        parts = [
            f"{'dense' if key == DENSE else key}: {member.describe()} over "
            f"{member.world_size} rank(s)"
            for key, member in zip(self.keys, self.sets)
        ]
        return "; ".join(parts)

    def state_bytes(self) -> int:
        if self.offloaded:  # each set's home counts its own masters, state and buffers
            return sum(member.state_bytes() for member in self.sets)
        total = sum(m.numel() * m.element_size() for s in self.sets for m in s.masters)
        for state in list(self.optimizer.state.values()):
            for value in list(state.values()):
                if torch.is_tensor(value) and value.dim() > 0:
                    total += value.numel() * value.element_size()
        return total

    def full_state_dict(self, module: torch.nn.Module, *, rank0_only: bool) -> dict:
        """The whole model's state dict, every expert of every rank under its global name
        (``moe/expert_names.py``); collective. Without ``rank0_only`` it is broadcast from
        rank 0 to every rank."""
        gathered = gather_experts_to_rank0(module, module.state_dict())
        if rank0_only:
            return gathered
        return broadcast_tensor_dict(
            gathered, 0, self.group, "of the gathered module state (expert parallel)"
        )

    def load_module_state(self, module: torch.nn.Module, state_dict: dict) -> None:
        """Loads a whole-model state dict with global expert names: this rank's experts are
        taken from it, the others' are ignored."""
        module.load_state_dict(to_local(state_dict, expert_layers(module)), strict=False)

    def destroy(self) -> None:
        for member in self.sets:
            member.destroy()

    # --- checkpoints: the sets' buckets one after another, in set order ---------------------------
    def layout_parts(self) -> list[LayoutPart]:
        """One part per set, its slices named by data-parallel rank and its param groups by the
        user's param group each came from."""
        parts = []
        for key, member, origins in zip(self.keys, self.sets, self.origins):
            (part,) = member.layout_parts(key=key, origins=tuple(origins))
            ranks = tuple(
                dist.get_group_rank(self.group, world_rank)
                for world_rank in dist.get_process_group_ranks(member.group)
            )
            parts.append(dataclasses.replace(part, group_ranks=ranks))
        return parts

    def owned_ranges(self) -> list[tuple[int, int]]:
        return [entry for member in self.sets for entry in member.owned_ranges()]

    def shard_state(self) -> list[dict]:
        return [entry for member in self.sets for entry in member.shard_state()]

    def stream_shard_state(self) -> list[dict]:
        return [entry for member in self.sets for entry in member.stream_shard_state()]

    def first_state(self) -> dict | None:
        for member in self.sets:
            entry = member.first_state()
            if entry is not None:
                return entry
        return None

    def load_shard_state(self, masters: list[torch.Tensor], states: list[dict] | None) -> None:
        counts = [len(member.buckets) for member in self.sets]
        if len(masters) != sum(counts):
            raise ValueError(
                f"load_shard_state needs one master slice per bucket: the sets have {counts} "
                f"buckets, got {len(masters)} slices"
            )
        start = 0
        for member, count in zip(self.sets, counts):
            member.load_shard_state(
                masters[start : start + count],
                None if states is None else states[start : start + count],
            )
            start += count

    def refresh_masters_from_params(self) -> None:
        for member in self.sets:
            member.refresh_masters_from_params()


def _checked_offload_options(offload: OptimizerOffload | None) -> OptimizerOffload | None:
    """``offload`` without what expert sets cannot do: errors for what was asked for, and
    ``step_during_backward`` off where it was only on by default."""
    if offload is None:
        return None
    if offload.delayed_update_after is not None:
        raise ValueError(
            "zero_optimization.offload_optimizer.delayed_param_update = true with expert-parallel "
            "MoE layers (ep_size > 1) is not supported (it would run one background step per "
            "expert set on one optimizer); set delayed_param_update to false, or use ep_size=1"
        )
    if offload.step_during_backward is True:
        raise ValueError(
            "zero_optimization.offload_optimizer.step_during_backward = true with expert-parallel "
            "MoE layers (ep_size > 1) is not supported (the sub-groups of every expert set would "
            "have to be tracked through one reducer); set it to false, or use ep_size=1"
        )
    if offload.ratio < 1.0:
        raise ValueError(
            f"zero_optimization.offload_optimizer.ratio = {offload.ratio} with expert-parallel "
            f"MoE layers (ep_size > 1) is not supported; use ratio 1.0 (the whole optimizer "
            f"state offloaded), or ep_size=1"
        )
    return dataclasses.replace(offload, step_during_backward=False)
