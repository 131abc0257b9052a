"""ZeRO-3 hooks: gather a module's parameters just before it runs, release them after, and
prefetch what comes next, as the C++ fetch schedule (csrc/zero/fetch_schedule) decides.

Fetch units (which modules' parameters are gathered and reduced together) come from the module
tree: ``unit_tree.py``.

One pass is a forward and its backward (or a forward alone, in evaluation). Per unit:

- before the module's forward: gather (waiting for a prefetch in flight, or fetching on demand);
- after its forward: release unless the schedule keeps it for a use soon; when the outputs need
  gradients, a hook on them gathers the unit again before the module's backward runs;
- after its backward: released once autograd has accumulated the gradient of every trainable
  parameter of the unit (later backward nodes cannot need them), or at the end of the pass for a
  unit with frozen parameters (a later node may still read those).

A group of small repeated blocks shares one unit: gathered before its first block's forward,
released after its last one's; every block's outputs hook the group's backward (the first to
fire gathers it), so a backward that starts inside the group finds it gathered.

A module that reads a partitioned parameter it does not own during its forward
(``nn.MultiheadAttention`` uses ``out_proj.weight`` without calling ``out_proj``) is caught by the
owner's ``_parameters`` mapping: the owner's unit is gathered then, and from then on together with
the reading module's own.

The schedule records the order of unit uses in the first pass and prefetches along it in later
ones; when the order changes it falls back to fetching on demand and records again. Its decisions
depend only on the sequence of uses, so ranks that run the same modules in the same order issue
the same gathers.

Ranks that do not (a data-dependent branch taken on some ranks only) would pair one rank's
gather with another's and hang or mix up parameters. So the ranks agree on the uses
(``pass_agreement.py``): in a pass that records or first replays a trace, with a check of a few
integers per rank before the gathers decided at a use are launched; in the later replays of a
trace, with a header riding on each gather, compared when it lands, before its parameters are
used. Every pass ends with one check. A disagreement raises on every rank, naming the module each
rank was at.

Each unit (``unit.py``) is gathered with one all-gather of its parameters' shards, and the
prefetches launched at one use share one all-gather up to ``stage3_prefetch_bucket_size``
elements (a demanded unit, waited for at once, gets one of its own). The checks
and the gathers run on two process groups of their own (the same ranks): gathers are never
interleaved with the gradient reductions that autograd hooks launch on the engine's group and do
not queue behind them, and a check does not queue behind a prefetch's gathers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...comm.collective_errors import new_group
from ...ops.zero import make_fetch_schedule
from ...utils.logging import logger
from ...utils.timer import (
    BACKWARD_ALL_GATHER_TIMER,
    BACKWARD_FETCH_SUBMIT_TIMER,
    BACKWARD_FETCH_WAIT_TIMER,
    FORWARD_ALL_GATHER_TIMER,
    FORWARD_FETCH_SUBMIT_TIMER,
    FORWARD_FETCH_WAIT_TIMER,
    timed,
)
from ...utils.z3_leaf_modules import LEAF_PARAMETER_ATTRIBUTE
from . import partition_parameters as pp
from .external_parameters import (
    external_parameter_registry,
    register_returned_parameters,
    returned_parameters,
)
from .gather_buffers import GatherBuffers
from .pass_agreement import PassAgreement
from .unit import ZeroUnit, unshard_together
from .unit_tree import units_from_module_tree


class ParameterCoordinator:
    def __init__(
        self,
        module: torch.nn.Module,
        group,
        *,
        prefetch_bucket_size: int,
        max_live_parameters: int,
        max_reuse_distance: int,
        unit_min_numel: int = 0,
    ):
        """``unit_min_numel``: modules with fewer partitioned elements join their parent's unit
        (``units_from_module_tree``)."""
        self.module = module
        self.world_size = dist.get_world_size(group)
        # Gathers and use checks get groups of their own (see the module docstring).
        ranks = dist.get_process_group_ranks(group)
        self.fetch_group = new_group(ranks) if self.world_size > 1 else None
        # gloo whatever the accelerator: a check is one integer per rank, and reading it on the
        # host must not wait for a device stream.
        self.check_group = new_group(ranks, backend="gloo") if self.world_size > 1 else None
        self.unit_of_module: dict[int, int] = {}
        self.units: list[ZeroUnit] = []
        self.unit_names: list[str] = []
        # Modules inside a leaf's subtree (z3_leaf_module): no unit, no hooks of their own.
        self._inside_leaf: set[int] = set()
        # Modules gathered whole with their subtree (leaves and repeated blocks).
        self._whole_units: set[int] = set()
        units = units_from_module_tree(
            module,
            self._inside_leaf,
            int(unit_min_numel),
            # A block is gathered whole within the live budget, whatever the prefetch bucket
            # (the schedule always takes one unit ahead, even one above the bucket). Measured
            # (benchmarks/zero3_step_profile.py --model transformer --whole-layers, both in the
            # same processes, 8 rounds): the 50M transformer's 5.95M-element layers as units
            # with a 5e6 bucket step in 1694 ms against 1742 ms per module (CPU 1221 vs 1216
            # ms, gathers waited for 209/193 vs 137/115 ms per step), with 25 collectives per
            # step instead of 43 (FSDP2: 26). Before the agreement rode with the gathers
            # (pass_agreement.py), a prefetch launched only when the use check settled, at the
            # unit's release, and whole layers were ~1.8x slower.
            int(max_live_parameters),
            self._whole_units,
        )
        # Blocks grouped into one unit (``unit_tree.py``): id(block) -> (unit, whether first,
        # whether last). The first block's forward fetches the unit and the last one's is done
        # with it; a block between them only waits for it (fetching it if it was not gathered:
        # a block skipped or run out of order).
        self._group_role: dict[int, tuple[int, bool, bool]] = {}
        for name, submodule, params, leaf, members in units:
            if len(members) == 1:
                self.unit_of_module[id(submodule)] = len(self.units)
            for position, member in enumerate(members if len(members) > 1 else ()):
                last = position == len(members) - 1
                self._group_role[id(member)] = (len(self.units), position == 0, last)
            self.units.append(ZeroUnit(params, name or "<root>"))
            self.unit_names.append(name or "<root>")
            if leaf:
                for param in params:
                    setattr(param, LEAF_PARAMETER_ATTRIBUTE, submodule)
        # Units prefetched at one use share an all-gather up to this many shard elements per
        # rank (the schedule's budgets count whole elements).
        self.coalesce_numel = int(prefetch_bucket_size) // max(1, self.world_size)
        self.schedule = make_fetch_schedule(
            [unit.padded_numel(self.world_size) for unit in self.units],
            prefetch_bucket_size=int(prefetch_bucket_size),
            max_live_parameters=int(max_live_parameters),
            max_reuse_distance=int(max_reuse_distance),
        )
        self._held = [False] * len(self.units)
        self._group_units = {unit for unit, _first, _last in self._group_role.values()}
        self._group_task = [None] * len(self.units)  # the backward that fetched a group's unit
        self._trainable_left: list[int] = [0] * len(self.units)
        self._releases_after_grads = [all(p.requires_grad for p in u) for u in self.units]
        self._units_of_param: dict[int, list[int]] = {}
        for index, unit in enumerate(self.units):
            for param in unit:
                self._units_of_param.setdefault(id(param), []).append(index)
        if self.world_size > 1:  # before any optimizer reads the shards (they move)
            shared = {key for key, units in self._units_of_param.items() if len(units) > 1}
            for unit in self.units:
                unit.keep_shards_together(shared)
        # id(param) -> what takes its gradient over as autograd has accumulated it (the stage's
        # reducer, ``hand_gradients_to``), called from the same hook that counts the unit down:
        # one Python hook per parameter, not one for the reducer and one for the release.
        self._grad_sinks: dict[int, object] = {}
        self._pass_open = False
        # (agreement in flight, gathers to launch once it succeeds, whether the first of them
        # is the unit demanded now, the unit whose use launches them)
        self._pending = None
        self.agreement = PassAgreement(
            self.world_size, self.check_group, self.fetch_group, self.unit_names
        )
        self._logged_divergence = 0
        self.gather_buffers = GatherBuffers()  # kept between gathers (``gather_buffers.py``)
        # The engine's wall-clock timers with ``wall_clock_breakdown`` (else None): fetches and
        # gathers timed under DeepSpeed's coordinator names (``utils/timer.py``).
        self.timers = None
        self._hooks = []
        # A destroyed engine's guards would refuse every forward of this new one.
        for handle in module.__dict__.pop("_ds_destroyed_guards", ()):
            handle.remove()
        self._install_hooks()

    def hand_gradients_to(self, sinks: dict[int, object]) -> None:
        """From now on ``sinks[id(param)](param)`` is called for each trainable parameter of a
        unit once autograd has accumulated its gradient, before the unit is counted down (and
        maybe released). The stage's reducer takes the gradients over this way instead of with
        hooks of its own (``ZeroPartitionedOptimizer.take_over_grad_hooks``)."""
        self._grad_sinks = dict(sinks)

    def unit_of_param(self) -> dict[int, int]:
        """``id(param)`` -> the first unit holding it (a tied parameter is in several)."""
        return {key: units[0] for key, units in self._units_of_param.items()}

    # --- hooks ------------------------------------------------------------------------------------
    def _install_hooks(self) -> None:
        # Units each module needs: its own (first), then those it was seen to borrow.
        self._module_units: dict[int, list[int]] = {}
        self._checked_modules: dict[int, list[torch.nn.Module]] = {}
        self._running: list[int] = []  # ids of the modules whose forward is under way
        self._module_of_id = {id(m): m for m in self.module.modules()}
        for submodule in self.module.modules():
            external_parameter_registry(submodule)  # DeepSpeed gives every module one
            if id(submodule) not in self._inside_leaf:
                unit = self.unit_of_module.get(id(submodule))
                self._module_units[id(submodule)] = [] if unit is None else [unit]
                # The modules whose parameters its forward checks (a whole unit's subtree),
                # listed once: walking named_parameters(recurse=True) in every forward was a
                # few ms per step on a deep model.
                self._checked_modules[id(submodule)] = (
                    list(submodule.modules()) if id(submodule) in self._whole_units else [submodule]
                )
            if any(pp.is_partitioned(p) for p in submodule._parameters.values() if p is not None):
                submodule.__dict__["_parameters"] = _FetchOnAccess(
                    submodule._parameters, self._fetch_on_access
                )
        self._hooked_params: set[int] = set()
        for unit in self.units:
            for param in unit:
                if param.requires_grad and id(param) not in self._hooked_params:
                    self._hooked_params.add(id(param))
                    self._hooks.append(
                        param.register_post_accumulate_grad_hook(self._after_accumulate)
                    )
        self.install_forward_hooks()

    # DeepSpeed's names (its ``DeepSpeedZeRoOffload``, reached as ``optimizer.parameter_offload``;
    # trl's generation helpers remove and restore the hooks through them). ``forward_hooks``: the
    # handles of the gathering module hooks. ``backward_hooks`` stays empty: the gathers before a
    # module's backward are hooks on its outputs, registered by its forward hook, so removing the
    # forward hooks removes them too; the parameters' gradient hooks (the reduction) are never
    # handed out, as removing them would make a backward silently skip the reduction.
    forward_hooks: list
    backward_hooks: list

    def install_forward_hooks(self) -> None:
        """(Re)installs the module hooks that gather and release the units; ones still
        installed are removed first, so calling it twice leaves one set."""
        self.remove_forward_hooks()
        hooks = [self.module.register_forward_pre_hook(self._root_pre_forward)]
        for submodule in self.module.modules():
            if id(submodule) not in self._inside_leaf:
                hooks.append(submodule.register_forward_pre_hook(self._pre_forward))
                hooks.append(submodule.register_forward_hook(self._post_forward))
        self._forward_handles = hooks
        self.forward_hooks = list(hooks)
        self.backward_hooks = []

    def remove_forward_hooks(self) -> None:
        """Removes the module hooks: the model then runs on whatever its parameters hold (the
        caller gathers them, as ``unwrap_model_for_generation`` does). Ends an open pass first
        (collective, as ``release_held``)."""
        if getattr(self, "_forward_handles", None) and self._pass_open:
            self.release_held()
        for handle in getattr(self, "_forward_handles", ()):
            handle.remove()
        self._forward_handles = []
        self.forward_hooks = []
        self.backward_hooks = []

    def _register_deepspeed_module(self, module: torch.nn.Module) -> None:
        """DeepSpeed's name for re-adding the hooks (trl calls it after generation)."""
        if module is not self.module:
            raise ValueError(
                "_register_deepspeed_module: the module must be the engine's own module "
                f"({type(self.module).__name__}), got {type(module).__name__}"
            )
        self.install_forward_hooks()

    def params_with_grad_hooks(self) -> set[int]:
        """``id(param)`` of every parameter whose gradient this coordinator hears of."""
        return set(self._hooked_params)

    def _root_pre_forward(self, module, inputs) -> None:
        if self._pass_open:
            self.end_pass()  # the previous forward had no backward (evaluation)
        self._pass_open = True
        self._running.clear()  # a forward that raised left its modules on the stack
        self.agreement.begin_pass(replaying=not self.schedule.recording())

    def _pre_forward(self, module, inputs) -> None:
        _check_registered(self._checked_modules[id(module)])
        self._running.append(id(module))
        role = self._group_role.get(id(module))
        if role is not None:
            unit, first, _last = role
            if first or not self._held[unit]:
                self.fetch(unit)
            else:
                self.units[unit].wait()
        for unit in self._module_units[id(module)]:
            self.fetch(unit)

    def _post_forward(self, module, inputs, output) -> None:
        self._running.pop()
        if torch._C._current_graph_task_id() != -1:
            # A forward run again inside the backward (activation checkpointing recomputes):
            # its unit is held for this backward and released after it, not now.
            return
        kept = self._keep_returned_for_caller(module, output) if self._running else ()
        units = self._module_units[id(module)]
        role = self._group_role.get(id(module))
        if role is not None:  # a block of a group: its backward needs the group's unit
            units = [role[0], *units]
        for unit in units if role is None or role[2] else units[1:]:
            if unit not in kept:
                self.done(unit)  # (a group's unit only after its last block)
        if units and torch.is_grad_enabled():
            # Not a returned parameter (a leaf: no backward of this module's runs through it, and
            # a hook on it would stay for good).
            tensors = [t for t in _tensors_in(output) if t.grad_fn is not None]
            if tensors:
                # One plain tensor hook per output, not register_multi_grad_hook: its lock,
                # closures and handles, alive from the forward to the backward, were the deep
                # model's largest ZeRO-3 cost (~1 ms per unit with the garbage collections that
                # the objects kept alive set off; measured in benchmarks/zero3_step_profile.py).
                entry = _PreBackward(self, tuple(units))
                for tensor in tensors:
                    tensor.register_hook(entry)

    def _fetch_on_access(self, param: torch.nn.Parameter) -> None:
        """A running module read a partitioned parameter it does not own (``MultiheadAttention``
        reads ``out_proj.weight`` without calling ``out_proj``): gather it now, and from now on
        with the module's own (the reads happen at the same point on every rank, so the gathers
        still match)."""
        if not self._running or not self._pass_open:
            return  # outside a forward: the parameter stays partitioned (ds_shape tells its shape)
        unit = self._units_of_param[id(param)][0]
        borrowed = self._module_units[self._running[-1]]
        if unit not in borrowed:
            borrowed.append(unit)
        self.fetch(unit)

    def _keep_returned_for_caller(self, module, output) -> set[int]:
        """The units of parameters ``module`` returned that a caller still running uses after
        ``module``'s forward ended (``external_parameters.register_returned_parameters``):
        held with the caller's units from now on, and not released here."""
        returned = [p for p in returned_parameters(output) if id(p) in self._units_of_param]
        if not returned:
            return set()
        running = [self._module_of_id[key] for key in self._running]
        for param in register_returned_parameters(module, returned, running):
            unit = self._units_of_param[id(param)][0]
            if unit not in self._module_units[self._running[-1]]:
                self._module_units[self._running[-1]].append(unit)
                self.fetch(unit)
        above = {unit for key in self._running for unit in self._module_units[key]}
        return {self._units_of_param[id(p)][0] for p in returned} & above

    def _pre_backward(self, units: list[int], task: int) -> None:
        """``task``: the backward (autograd graph task) that reached ``units``' module."""
        for unit in units:
            if unit in self._group_units:
                # Every block of a group hooks its outputs (a later layer's output may reach
                # the loss by another way, starting an earlier block's backward first); the
                # first to fire fetches the unit for this backward, the others find it held.
                if self._held[unit] and self._group_task[unit] == task:
                    continue
                self._group_task[unit] = task
            self._trainable_left[unit] = sum(1 for p in self.units[unit] if p.requires_grad)
            self.fetch(unit)

    def _after_accumulate(self, param: torch.Tensor) -> None:
        key = id(param)
        sink = self._grad_sinks.get(key)
        if sink is not None:
            sink(param)
        for unit in self._units_of_param.get(key, ()):
            if not self._held[unit] or not self._releases_after_grads[unit]:
                continue
            self._trainable_left[unit] -= 1
            if self._trainable_left[unit] == 0:
                self.done(unit)

    # --- fetch and release ------------------------------------------------------------------------
    def fetch(self, unit: int) -> None:
        """Gathers ``unit`` for a use now (waiting for it) and launches the prefetches the
        schedule decides. Gathers are launched only once the ranks agreed on this use; the
        agreement is waited for at once only when ``unit`` itself must be gathered, otherwise
        (it was prefetched) at the next fetch or release, behind this module's compute. Both
        are points every rank reaches in the same order, so the gathers interleave with the
        gradient reductions identically on every rank (NCCL needs that across groups)."""
        timers = self.timers  # None unless wall_clock_breakdown: no timer objects per use
        backward = timers is not None and _in_backward()
        with timed(timers, BACKWARD_FETCH_SUBMIT_TIMER if backward else FORWARD_FETCH_SUBMIT_TIMER):
            if self._pending is not None:
                self._settle()
            self.agreement.record_use(unit)
            # One call into the schedule, not one per question (each costs a few microseconds).
            launches, diverged = self.schedule.on_use_and_diverged(unit)
            if diverged and self.agreement.folded:
                self.agreement.deviate(unit)  # raises, or the rest of the pass is checked
            if launches:
                # A folded pass launches at once (its gathers carry the check); a checked one
                # once the check started here landed.
                check = None if self.agreement.folded else self.agreement.start_check(unit)
                self._pending = (check, launches, launches[0] == unit, unit)
            if unit in launches or self.agreement.folded:
                self._settle()
        if diverged and self._logged_divergence < self.schedule.divergences():
            self._logged_divergence = self.schedule.divergences()
            if self._logged_divergence == 1:
                logger.info(
                    "deepspeed_cpp: ZeRO-3: the modules ran in another order than in the "
                    "recorded pass (at %s); fetching on demand and recording again",
                    self.unit_names[unit],
                )
        with timed(timers, BACKWARD_FETCH_WAIT_TIMER if backward else FORWARD_FETCH_WAIT_TIMER):
            self.units[unit].wait()

    def _settle(self) -> None:
        """Waits for the pending agreement and launches the gathers decided with it."""
        if self._pending is None:
            return
        check, launches, demand, use = self._pending
        self._pending = None
        self.agreement.finish_check(check)
        timers = self.timers
        name = (
            None
            if timers is None
            else BACKWARD_ALL_GATHER_TIMER
            if _in_backward()
            else FORWARD_ALL_GATHER_TIMER
        )
        with timed(timers, name):
            for gathered in launches:
                self._held[gathered] = True
            # A demanded unit (it comes first) is waited for at once: it gets a collective of
            # its own, so that the prefetches, sharing one, stay in flight behind its compute.
            demanded = launches[:1] if demand else []
            for together in (demanded, launches[len(demanded) :]):
                unshard_together(
                    [self.units[gathered] for gathered in together],
                    self.fetch_group,
                    self.coalesce_numel,
                    self.agreement,
                    use,
                    self.gather_buffers,
                )

    def done(self, unit: int) -> None:
        if self._pending is not None:
            self._settle()
        if self._held[unit] and self.schedule.on_done(unit):
            self._release(unit)

    def _release(self, unit: int) -> None:
        self._held[unit] = False
        self.units[unit].reshard()

    def end_pass(self) -> None:
        """Releases every unit still held and lets the schedule adopt or drop its trace."""
        self._pass_open = False
        if self.agreement.failed:  # every rank raised a disagreement: nothing pending pairs
            self._pending = None
        try:
            self._settle()
            self.agreement.end_pass(diverged=self.schedule.diverged())
        finally:
            # Also after a disagreement (raised on every rank, here or earlier in the pass):
            # every rank then records its next pass afresh.
            if self.agreement.failed:
                self.schedule.invalidate()
            for unit in self.schedule.end_pass():
                if self._held[unit]:
                    self._release(unit)

    def release_held(self) -> None:
        """Ends an open pass, releasing every unit it still holds (an evaluation forward
        leaves its prefetches held until the next forward): DeepSpeed's
        ``empty_partition_cache``. Collective: every rank calls it at the same point. A
        backward still to come gathers its units again."""
        if self._running:
            raise RuntimeError(
                "empty_partition_cache() inside a forward of the model (a module is still "
                "running); call it between forwards, as after an evaluation loop"
            )
        if self._pass_open:
            self.end_pass()
        self.gather_buffers.clear()

    # --- accounting and teardown ------------------------------------------------------------------
    def live_numel(self) -> int:
        return int(self.schedule.live_numel())

    def peak_live_numel(self) -> int:
        return int(self.schedule.peak_live_numel())

    def destroy(self) -> None:
        """Removes the hooks; calling the model afterwards raises an error naming a partitioned
        parameter instead of failing on an empty tensor."""
        if self._pass_open:
            self.end_pass()
        self.remove_forward_hooks()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.gather_buffers.clear()
        for submodule in self.module.modules():
            if isinstance(submodule._parameters, _FetchOnAccess):
                submodule.__dict__["_parameters"] = dict(submodule._parameters)
        for unit in self.units:
            for param in unit:
                param.__dict__.pop(LEAF_PARAMETER_ATTRIBUTE, None)
        for name in ("fetch_group", "check_group"):
            if getattr(self, name) is not None:
                dist.destroy_process_group(getattr(self, name))
                setattr(self, name, None)
        for name, submodule in self.module.named_modules():
            # Every module owning partitioned parameters names itself (not the unit it was
            # gathered with: a small module's is its parent's).
            if any(pp.is_partitioned(p) for p in submodule.parameters(recurse=False)):
                guard = _destroyed_guard(name or "<root>")
                self._hooks.append(submodule.register_forward_pre_hook(guard))
        # Kept on the model so that the next engine's coordinator removes them.
        self.module.__dict__["_ds_destroyed_guards"] = list(self._hooks)


def _in_backward() -> bool:
    """Whether autograd's backward is running this thread's code (a hook of it)."""
    return torch._C._current_graph_task_id() != -1


def _destroyed_guard(name: str):
    def guard(module, inputs) -> None:
        raise RuntimeError(
            f"module '{name}' has ZeRO-3 partitioned parameters and the engine that gathered "
            f"them was destroyed; gather them with deepspeed_cpp.zero.GatheredParameters or "
            f"wrap the model in a new engine"
        )

    return guard


class _PreBackward:
    """The hook on a module's outputs that gathers its units again before its backward runs:
    called with each output's gradient, it acts on the first of one backward (autograd's graph
    task), as ``register_multi_grad_hook(mode="any")`` would."""

    __slots__ = ("coordinator", "units", "task")

    def __init__(self, coordinator: ParameterCoordinator, units: tuple[int, ...]):
        self.coordinator = coordinator
        self.units = units  # as they were at the forward
        self.task = None

    def __call__(self, grad):
        task = torch._C._current_graph_task_id()
        if task != self.task:
            self.task = task
            self.coordinator._pre_backward(self.units, task)


class _FetchOnAccess(dict):
    """A module's ``_parameters`` that reports reads of a partitioned, not gathered parameter
    (``module.weight`` goes through ``__getitem__``; iteration does not)."""

    def __init__(self, parameters: dict, on_miss):
        super().__init__(parameters)
        self.on_miss = on_miss

    def __getitem__(self, name):
        param = super().__getitem__(name)
        if (
            param is not None
            and pp.is_partitioned(param)
            and param.ds_status != pp.ZeroParamStatus.AVAILABLE
        ):
            self.on_miss(param)
        return param


def _check_registered(modules: list[torch.nn.Module]) -> None:
    for owner in modules:
        # Through dict.values(): _FetchOnAccess reports reads by name only (``__getitem__``).
        for param in dict.values(owner._parameters):
            if param is not None and not pp.is_zero_param(param):
                name = next(n for n, p in owner.named_parameters(recurse=False) if p is param)
                raise RuntimeError(
                    f"parameter '{name}' of {type(owner).__name__} (shape "
                    f"{list(param.shape)}) is not a ZeRO-3 parameter: it was created after "
                    f"deepspeed_cpp.initialize partitioned the model, outside zero.Init; create "
                    f"it before initialize (or under zero.Init) so that it is partitioned"
                )


def _tensors_in(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)
