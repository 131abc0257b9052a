"""``PipelineModule``: a model written as a list of layers, of which each process builds and runs
only its stage's contiguous range; ``LayerSpec`` / ``TiedLayerSpec`` build layers lazily (a stage
never allocates another stage's layers) and tie weights across stages (tied embeddings)."""

from __future__ import annotations

import functools
import os
import random
import re
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ...comm.collective_errors import named_collective, new_group
from ..activation_checkpointing import checkpointing
from ..layer_partitions import partition_balanced, partition_uniform
from .topology import PipeDataParallelTopology, PipelineParallelGrid, ProcessTopology


class PipelineError(Exception):
    """A pipeline was built or driven in a way that cannot work."""


class UnsupportedPartitionMethod(PipelineError, NotImplementedError):
    """A ``partition_method`` not implemented (DeepSpeed raises NotImplementedError for these)."""


class LayerSpec:
    """A layer to build later: ``LayerSpec(nn.Linear, 10, 20)`` builds ``nn.Linear(10, 20)`` on
    the stage that owns it, and nowhere else."""

    def __init__(self, typename, *module_args, **module_kwargs):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise PipelineError(
                f"LayerSpec needs an nn.Module subclass as its first argument, got {typename!r}"
            )
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args]
        args += [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer whose weights (``tied_weight_attr``, dotted names allowed) are one set of weights
    wherever the same ``key`` appears: built once per stage, kept equal across stages by summing
    their gradients over the tie group. ``forward_fn(module, inputs)`` replaces the module's
    forward at this position (an embedding reused as the output projection)."""

    def __init__(
        self, key, typename, *module_args, forward_fn=None, tied_weight_attr=("weight",), **kwargs
    ):
        super().__init__(typename, *module_args, **kwargs)
        self.key = key
        self.forward_fn = forward_fn
        if isinstance(tied_weight_attr, str):
            tied_weight_attr = [tied_weight_attr]
        self.tied_weight_attr = list(tied_weight_attr)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy

        numpy.random.seed(seed % (2**32))
    except ImportError:
        pass


def _layer_name(layer) -> str | None:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", None)


def _recursive_getattr(module: nn.Module, dotted: str) -> torch.Tensor:
    for part in dotted.split("."):
        module = getattr(module, part)
    return module


class PipelineModule(nn.Module):
    """DeepSpeed's pipeline module. ``layers`` is a sequence of modules, ``LayerSpec``s,
    ``TiedLayerSpec``s and plain callables (run as they are); ``num_stages`` (dividing the world
    size; the rest is data parallelism) or a ``topology``; ``loss_fn(outputs, labels)`` runs on
    the last stage. ``partition_method``: ``"parameters"`` (balance trainable parameter counts),
    ``"uniform"`` (balance layer counts) or ``"type:<regex>"`` (balance the layers whose class
    name matches); ``"profile"`` is refused (``NotImplementedError``) as DeepSpeed 0.19.8 refuses
    it. ``activation_checkpoint_interval=k`` recomputes every run of ``k`` layers in
    backward through ``activation_checkpoint_func`` (default, as in DeepSpeed,
    ``deepspeed.checkpointing.checkpoint``: it replays the RNG and the tracker's states so dropout
    repeats exactly, and honours ``deepspeed.checkpointing.configure``'s partitioning and host
    copies). ``seed_layers`` seeds the RNG with ``base_seed + layer index`` before building each
    layer (and before running it), so a layer starts from the same weights whatever stage builds
    it."""

    def __init__(
        self,
        layers,
        num_stages: int | None = None,
        topology: ProcessTopology | None = None,
        loss_fn: Callable | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], None] | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable | None = None,
        checkpointable_layers: list[str] | None = None,
        dynamic_shape: bool = False,
    ):
        super().__init__()
        if num_stages is None and topology is None:
            raise PipelineError(
                "PipelineModule needs num_stages=<int> or topology=<ProcessTopology>"
            )
        if not dist.is_initialized():
            raise PipelineError(
                "PipelineModule needs torch.distributed initialised first: call "
                "deepspeed.init_distributed() before building it"
            )
        if checkpointable_layers is not None and not isinstance(checkpointable_layers, list):
            raise PipelineError(
                "checkpointable_layers must be a list of class names, got "
                f"{checkpointable_layers!r}"
            )
        if int(activation_checkpoint_interval) < 0:
            raise PipelineError(
                f"activation_checkpoint_interval must be >= 0, got {activation_checkpoint_interval}"
            )
        self.loss_fn = loss_fn
        self.seed_layers = seed_layers
        self.seed_fn = seed_fn
        self.base_seed = base_seed
        self.checkpointable_layers = checkpointable_layers
        self.activation_checkpoint_interval = int(activation_checkpoint_interval)
        self.activation_checkpoint_func = activation_checkpoint_func or checkpointing.checkpoint
        self.dynamic_shape = dynamic_shape
        self.micro_offset = 0
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))

        if topology is None:
            if int(num_stages) < 1 or self.world_size % int(num_stages) != 0:
                raise PipelineError(
                    f"num_stages ({num_stages}) must be >= 1 and divide the world size "
                    f"({self.world_size}); the quotient is the number of data-parallel replicas"
                )
            topology = PipeDataParallelTopology(
                num_pp=int(num_stages), num_dp=self.world_size // int(num_stages)
            )
        elif num_stages is not None and topology.get_dim("pipe") != int(num_stages):
            raise PipelineError(
                f"num_stages={num_stages} disagrees with the topology's pipe dimension "
                f"{topology.get_dim('pipe')}; give one of them"
            )
        self._topo = topology
        self.num_stages = topology.get_dim("pipe")
        self._grid = PipelineParallelGrid(topology)
        self.stage_id = self._grid.get_stage_id()

        self._layer_specs = list(layers)
        self._num_layers = len(self._layer_specs)
        if self._num_layers < self.num_stages:
            raise PipelineError(
                f"the pipeline has {self._num_layers} layers but {self.num_stages} stages; every "
                "stage needs at least one layer"
            )
        self.parts = self._partition_layers(partition_method)
        self._local_start = self.parts[self.stage_id]
        self._local_stop = self.parts[self.stage_id + 1]

        self.forward_funcs: list = []
        self.fwd_map: dict[str, int] = {}
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self._build()
        self.tied_comms = self._index_tied_modules()
        self._synchronize_tied_weights()

    # --- building -----------------------------------------------------------------------------
    def _partition_layers(self, method: str) -> list[int]:
        method_lower = str(method).lower()
        if method_lower == "uniform":
            parts = partition_uniform(self._num_layers, self.num_stages)
        elif method_lower == "parameters":
            parts = partition_balanced(self._count_layer_params(), self.num_stages)
        elif method_lower.startswith("type:"):
            pattern = method[len("type:") :]
            regex = re.compile(pattern, re.IGNORECASE)
            weights = [
                1 if (name := _layer_name(layer)) is not None and regex.search(name) else 0
                for layer in self._layer_specs
            ]
            if not any(weights):
                raise PipelineError(
                    f"partition_method={method!r}: no layer's class name matches {pattern!r} "
                    f"(layers: {[_layer_name(layer) for layer in self._layer_specs]})"
                )
            parts = partition_balanced(weights, self.num_stages)
        elif method_lower == "profile":
            # DeepSpeed 0.19.8 names this method but refuses it (NotImplementedError), as here.
            raise UnsupportedPartitionMethod(
                f"partition_method={method!r} (timing each layer to balance the stages) is not "
                "implemented, as in DeepSpeed; use 'parameters', 'uniform' or 'type:<regex>'"
            )
        else:
            raise UnsupportedPartitionMethod(
                f"partition_method={method!r} is not one of 'parameters', 'uniform', 'type:<regex>'"
            )
        empty = [s for s in range(self.num_stages) if parts[s + 1] <= parts[s]]
        if empty:
            raise PipelineError(
                f"partition_method={method!r} leaves stage(s) {empty} without layers (bounds "
                f"{parts} for {self._num_layers} layers, {self.num_stages} stages); use "
                "'uniform' or fewer stages"
            )
        return parts

    def _count_layer_params(self) -> list[int]:
        counts = []
        for layer in self._layer_specs:
            module = layer.build() if isinstance(layer, LayerSpec) else layer
            if isinstance(module, nn.Module):
                counts.append(sum(p.numel() for p in module.parameters() if p.requires_grad))
            else:
                counts.append(0)
        return counts

    def _build(self) -> None:
        for layer_idx in range(self._local_start, self._local_stop):
            layer = self._layer_specs[layer_idx]
            if self.seed_layers:
                (self.seed_fn or _seed_everything)(self.base_seed + layer_idx)
            if isinstance(layer, PipelineModule):
                raise PipelineError(
                    f"layer {layer_idx} is a PipelineModule; nesting is not supported"
                )
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                module = self.tied_modules[layer.key]
                if layer.forward_fn is not None:
                    module = functools.partial(layer.forward_fn, module)
                self.forward_funcs.append(module)
            elif isinstance(layer, (LayerSpec, nn.Module)):
                module = layer.build() if isinstance(layer, LayerSpec) else layer
                self.forward_funcs.append(module)
                self.fwd_map[str(layer_idx)] = len(self.forward_funcs) - 1
                self.add_module(str(layer_idx), module)
            elif callable(layer):
                self.forward_funcs.append(layer)
            else:
                raise PipelineError(
                    f"layer {layer_idx} ({layer!r}) is not an nn.Module, LayerSpec or callable"
                )
        for param in self.parameters():
            param.ds_pipe_replicated = False

    def _index_tied_modules(self) -> dict:
        """A group per tie key and replica over the stages holding it; every rank creates every
        group in the same order (sorted keys)."""
        comms: dict = {}
        if self.num_stages == 1:
            return comms
        keys = sorted({s.key for s in self._layer_specs if isinstance(s, TiedLayerSpec)})
        for key in keys:
            stages = sorted(
                {
                    self.stage_owner(i)
                    for i, s in enumerate(self._layer_specs)
                    if isinstance(s, TiedLayerSpec) and s.key == key
                }
            )
            for pipe_line in self._topo.get_axis_comm_lists("pipe"):
                ranks = [pipe_line[s] for s in stages]
                group = new_group(ranks) if len(ranks) > 1 else None
                if self.global_rank in ranks and len(ranks) > 1:
                    comms[key] = {
                        "ranks": ranks,
                        "group": group,
                        "weight_attr": self.tied_weight_attrs[key],
                        "module": self.tied_modules[key],
                    }
                    if self.global_rank != ranks[0]:
                        # Counted once in whole-model gradient norms: on its first stage.
                        for param in self.tied_modules[key].parameters():
                            param.ds_pipe_replicated = True
        return comms

    def _synchronize_tied_weights(self) -> None:
        for key, comm in self.tied_comms.items():
            for attr in comm["weight_attr"]:
                weight = _recursive_getattr(self.tied_modules[key], attr)
                with named_collective(f"broadcast of tied weight {key}.{attr}"), torch.no_grad():
                    dist.broadcast(weight.data, src=comm["ranks"][0], group=comm["group"])

    def allreduce_tied_weight_gradients(self) -> None:
        """Sums the tied weights' gradients over their stages (each stage's partial gradient)."""
        for weight, group, what in self._tied_weight_grads():
            if weight.grad is not None:
                with named_collective(f"all_reduce of the gradient of tied weight {what}"):
                    dist.all_reduce(weight.grad, group=group)

    def _tied_weight_grads(self):
        for key, comm in self.tied_comms.items():
            for attr in comm["weight_attr"]:
                weight = _recursive_getattr(self.tied_modules[key], attr)
                yield weight, comm["group"], f"{key}.{attr}"

    def get_tied_weights_and_groups(self) -> list[tuple[torch.Tensor, dist.ProcessGroup]]:
        return [(weight, group) for weight, group, _ in self._tied_weight_grads()]

    # --- running ------------------------------------------------------------------------------
    def forward(self, forward_input):
        self.micro_offset += 1
        micro_offset = self.micro_offset + 1

        def run_range(start: int, end: int):
            def run(*inputs):
                x = inputs[0] if len(inputs) == 1 else inputs
                for offset, layer in enumerate(self.forward_funcs[start:end]):
                    self.curr_layer = start + offset + self._local_start
                    if self.seed_layers:
                        seed = self.base_seed * micro_offset + self.curr_layer
                        (self.seed_fn or _seed_everything)(seed)
                    x = layer(x)
                return x

            return run

        interval = self.activation_checkpoint_interval
        if interval == 0:
            return run_range(0, len(self.forward_funcs))(forward_input)
        x = forward_input
        for start in range(0, len(self.forward_funcs), interval):
            end = min(start + interval, len(self.forward_funcs))
            inputs = x if isinstance(x, tuple) else (x,)
            if self._is_checkpointable(self.forward_funcs[start:end]):
                x = self.activation_checkpoint_func(run_range(start, end), *inputs)
            else:
                x = run_range(start, end)(*inputs)
        return x

    def _is_checkpointable(self, funcs) -> bool:
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        # Layers without parameters gain nothing from recomputation.
        return any(isinstance(f, nn.Module) and any(True for _ in f.parameters()) for f in funcs)

    # --- what the engine and scripts ask ------------------------------------------------------
    def partitions(self) -> list[int]:
        return self.parts

    def stage_owner(self, layer_idx: int) -> int:
        if not 0 <= layer_idx < self._num_layers:
            raise PipelineError(f"layer {layer_idx} is outside 0..{self._num_layers - 1}")
        for stage in range(self.num_stages):
            if self.parts[stage] <= layer_idx < self.parts[stage + 1]:
                return stage
        raise PipelineError(f"layer {layer_idx} is owned by no stage (bounds {self.parts})")

    def set_checkpoint_interval(self, interval: int) -> None:
        if int(interval) < 0:
            raise PipelineError(f"activation checkpoint interval must be >= 0, got {interval}")
        self.activation_checkpoint_interval = int(interval)

    def topology(self) -> ProcessTopology:
        return self._topo

    def mpu(self) -> PipelineParallelGrid:
        return self._grid

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def local_layer_range(self) -> range:
        return range(self._local_start, self._local_stop)

    def tied_layer_keys(self) -> dict[int, str]:
        """Global layer index -> tie key, for this stage's tied layers."""
        return {
            i: self._layer_specs[i].key
            for i in self.local_layer_range()
            if isinstance(self._layer_specs[i], TiedLayerSpec)
        }
