"""Memory estimators for the model states (parameters, gradients, optimizer state) of ZeRO-2 and
ZeRO-3 training, under DeepSpeed's public names (``estimate_zero2_model_states_mem_needs`` ...,
re-exported from ``stage_1_and_2`` and ``stage3`` as DeepSpeed does), to choose an offload
configuration before training.

Each function returns (or prints) two figures: ``cpu_mem``, the host memory of one node, and
``gpu_mem``, the memory of one accelerator (one rank). Activations, communication buffers and the
allocator's overhead are not counted; ``additional_buffer_factor`` scales the host figure only,
as in DeepSpeed.

The figures predict this engine's allocations, with an Adam-family optimizer (fp32 exp_avg and
exp_avg_sq per element). Per parameter, with ``b`` the bytes of the model's dtype (2 for fp16 and
bf16, 4 for fp32) and ``N`` the number of ranks:

ZeRO-2 (``partitioned_optimizer``): every rank keeps the whole model in its dtype (``b``) and,
for its 1/N shard, fp32 master weights (4; none for an fp32 model, whose parameters are their
own masters), fp32 gradients (4) and Adam's two moments (8). Gradients are reduced bucket by
bucket during backward straight into the fp32 shard gradients and freed, so no whole-size
gradient stays.

- no offload: ``gpu = b*P + (4 + 4 + 8)*P/N`` (fp32 model: ``4*P + 12*P/N``).
  DeepSpeed: ``2*P + 18*P/N``. DeepSpeed's 18 also counts a 16-bit partition of the gradients,
  which it keeps beside the fp32 one; ours reduces into the fp32 shard only: 16, not 18.
- offload_optimizer=cpu: ``gpu = b*P + 4*P/N``: the reducer still accumulates the fp32 shard
  gradients on the device (copied to the host at each step; DeepSpeed's ``2*P`` has none); the
  master shards, moments and a host copy of the shard gradients (16 per parameter, summed over
  the node's ranks: ``16*P/num_nodes``) live on the host, which also has
  to hold the model in fp32 in every process while it is built (``4*P*num_gpus_per_node``, not at
  the same time): ``cpu = max(4*num_gpus_per_node, 16/num_nodes)*P``. DeepSpeed writes
  ``max(4*total_gpus, 16)*P``: the same on one node; over several nodes ours counts one node's
  processes and one node's share of the shards, which is what one host holds.
- without offload, the host holds the fp32 model in every process while it is built:
  ``cpu = 4*P*num_gpus_per_node`` (as DeepSpeed).

ZeRO-3 (``stage3``): every rank keeps only its shard of every parameter (``ds_tensor``, ``b``
per parameter) plus the ZeRO-2 shard state above. While a layer runs it is gathered whole in the
model's dtype, and in backward its whole gradient exists (in the model's dtype) until the reducer
takes it: ``largest_layer_memory = 2*b*L`` for the largest layer's ``L`` parameters, DeepSpeed's
``4*L`` for 16-bit models (8*L for fp32 ones). Like DeepSpeed's, this assumes one layer gathered
at a time: with ``stage3_max_reuse_distance`` and ``stage3_max_live_parameters`` at their
defaults (1e9), parameters that backward uses again stay gathered from forward to backward, up to
``max_live_parameters`` elements (a model smaller than that is then gathered whole at the peak;
measured: all 16 layers of a 4.2M-parameter model). Parameters under
``stage3_param_persistence_threshold`` stay whole on every rank; like DeepSpeed, the estimate
treats every parameter as partitioned.

- no offload: ``gpu = LLM + (b + 4 + 4 + 8)*P/N`` = DeepSpeed's ``LLM + 18*P/N`` for 16-bit
  models; an fp32 model's shards are their own masters: ``LLM + 16*P/N``.
- offload_optimizer=cpu: ``gpu = LLM + (b + 4)*P/N`` (the shard gradients, as ZeRO-2's);
  host: ``16*P`` per node's share (as DeepSpeed).
- offload_param=cpu too: ``gpu = LLM + 4*P/N``; the parameter shards join the host state:
  ``(16 + b)*P`` per node's share, DeepSpeed's 18 for 16-bit models (the host masters are copies
  of the shards also for an fp32 model: 20).
- host without ``zero_init`` (the model built whole in fp32 in every process first):
  ``max(4*num_gpus_per_node, host share)*P``; with it and without offload, one layer at a time:
  ``4*L*num_gpus_per_node`` (both as DeepSpeed).

So for fp16/bf16 models on one node, the host figures equal DeepSpeed's; the device figures
differ for ZeRO-2 without offload (16 bytes per parameter over the ranks where DeepSpeed counts
18) and by the device's fp32 shard gradients (4 per parameter over the ranks) with offload.
Every row is checked against the engine's allocations (``tests/test_estimators.py``).

``dtype`` (keyword-only, not in DeepSpeed) is the model's training dtype: a ``torch.dtype`` or
"fp16"/"bf16"/"fp32"; the default, fp16, is DeepSpeed's assumption.
"""

from __future__ import annotations

import torch

__all__ = [
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
]

_ADAM_STATE = 8  # exp_avg and exp_avg_sq, fp32
_SHARD_GRAD = 4  # fp32 shard gradients
_MASTER = 4  # fp32 master weights
_FP32_MODEL = 4  # the model as built, before the engine casts or partitions it

_DTYPES = {
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


def _param_bytes(dtype) -> int:
    """Bytes per parameter of the model's training dtype (2 or 4)."""
    resolved = _DTYPES.get(dtype.lower()) if isinstance(dtype, str) else dtype
    if resolved not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype must be fp16, bf16 or fp32 (a torch.dtype or a name), got {dtype}")
    return torch.empty((), dtype=resolved).element_size()


def _master_bytes(param_bytes: int) -> int:
    """fp32 master weights beside the parameters: none when the parameters are fp32."""
    return 0 if param_bytes == 4 else _MASTER


def _check_world(num_gpus_per_node: int, num_nodes: int) -> int:
    if num_gpus_per_node < 1 or num_nodes < 1:
        raise ValueError(
            f"num_gpus_per_node and num_nodes must be at least 1, got "
            f"{num_gpus_per_node} and {num_nodes}"
        )
    return num_gpus_per_node * num_nodes


def _header(num_gpus_per_node: int, num_nodes: int, params_line: str) -> None:
    nodes = "nodes" if num_nodes > 1 else "node"
    gpus = "GPUs" if num_gpus_per_node > 1 else "GPU"
    print("Estimated memory needed for params, optim states and gradients for a:")
    print(f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.")
    print(f"SW: Model with {params_line}.")
    print("  per CPU  |  per GPU |   Options")


def _row(cpu_mem: int, gpu_mem: int, options: str) -> None:
    print(f" {cpu_mem / 2**30:7.2f}GB | {gpu_mem / 2**30:6.2f}GB | {options}")


def _device(offloaded: bool) -> str:
    return f"{'cpu':4}" if offloaded else "none"


def _unique_params(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's parameters, a shared (tied) one once. A ZeRO-3 parameter counts whole."""
    seen, result = set(), []
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            result.append(param)
    return result


def _numel(param: torch.Tensor) -> int:
    return int(getattr(param, "ds_numel", param.numel()))


def _total_and_largest_layer(model: torch.nn.Module) -> tuple[int, int]:
    total = sum(_numel(p) for p in _unique_params(model))
    largest = 0
    for module in model.modules():
        largest = max(largest, sum(_numel(p) for p in module.parameters(recurse=False)))
    return total, largest


# --- ZeRO-2 -----------------------------------------------------------------------------------


def estimate_zero2_model_states_mem_needs(
    total_params,
    num_gpus_per_node=1,
    num_nodes=1,
    cpu_offload=True,
    additional_buffer_factor=1.5,
    *,
    dtype=torch.float16,
):
    """``(cpu_mem, gpu_mem)`` in bytes for ZeRO-2 training of ``total_params`` parameters:
    the host memory of one node and the memory of one rank's accelerator (see the module
    docstring for the terms and where they differ from DeepSpeed's)."""
    world = _check_world(num_gpus_per_node, num_nodes)
    b = _param_bytes(dtype)
    shard_state = _master_bytes(b) + _SHARD_GRAD + _ADAM_STATE
    if cpu_offload:
        gpu_mem = b * total_params + int(_SHARD_GRAD * total_params / world)
        host_share = (_MASTER + _SHARD_GRAD + _ADAM_STATE) / num_nodes
        cpu_mem = (
            total_params
            * max(_FP32_MODEL * num_gpus_per_node, host_share)
            * additional_buffer_factor
        )
    else:
        gpu_mem = b * total_params + int(shard_state * total_params / world)
        cpu_mem = total_params * _FP32_MODEL * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def estimate_zero2_model_states_mem_needs_all_live(
    model, num_gpus_per_node=1, num_nodes=1, additional_buffer_factor=1.5, *, dtype=torch.float16
):
    """Prints the ZeRO-2 estimates, with and without optimizer offload, for ``model`` (its
    parameters counted once each, tied ones too)."""
    total_params, _ = _total_and_largest_layer(model)
    estimate_zero2_model_states_mem_needs_all_cold(
        total_params,
        num_gpus_per_node=num_gpus_per_node,
        num_nodes=num_nodes,
        additional_buffer_factor=additional_buffer_factor,
        dtype=dtype,
    )


def estimate_zero2_model_states_mem_needs_all_cold(
    total_params,
    num_gpus_per_node=1,
    num_nodes=1,
    additional_buffer_factor=1.5,
    *,
    dtype=torch.float16,
):
    """Prints the ZeRO-2 estimates, with and without optimizer offload, for a model of
    ``total_params`` parameters that need not exist."""
    _check_world(num_gpus_per_node, num_nodes)
    _header(num_gpus_per_node, num_nodes, f"{int(total_params / 1e6)}M total params")
    for cpu_offload in (True, False):
        cpu_mem, gpu_mem = estimate_zero2_model_states_mem_needs(
            total_params,
            num_gpus_per_node,
            num_nodes,
            cpu_offload=cpu_offload,
            additional_buffer_factor=additional_buffer_factor,
            dtype=dtype,
        )
        _row(cpu_mem, gpu_mem, f"offload_optimizer={_device(cpu_offload)}")


# --- ZeRO-3 -----------------------------------------------------------------------------------


def estimate_zero3_model_states_mem_needs(
    total_params,
    largest_layer_params,
    num_gpus_per_node=1,
    num_nodes=1,
    cpu_offload=True,
    cpu_offload_params=True,
    zero_init=True,
    additional_buffer_factor=1.5,
    *,
    dtype=torch.float16,
):
    """``(cpu_mem, gpu_mem, largest_layer_memory)`` in bytes for ZeRO-3 training: the host
    memory of one node, the memory of one rank's accelerator (the largest layer's working set
    included) and that working set alone (see the module docstring). ``cpu_offload``:
    offload_optimizer to the CPU; ``cpu_offload_params``: offload_param too (only with
    ``cpu_offload``, as DeepSpeed's table); ``zero_init``: the model is built under
    ``zero.Init``."""
    world = _check_world(num_gpus_per_node, num_nodes)
    b = _param_bytes(dtype)
    nodes_share = 1 / num_nodes
    largest_layer_memory = 2 * b * largest_layer_params
    if cpu_offload:
        host_state = _MASTER + _SHARD_GRAD + _ADAM_STATE
        if cpu_offload_params:
            gpu_mem = largest_layer_memory + int(_SHARD_GRAD * total_params / world)
            host_state += b  # the shards; the host masters are copies of them
        else:
            gpu_mem = largest_layer_memory + int((b + _SHARD_GRAD) * total_params / world)
        host = host_state * nodes_share
        if not zero_init:
            host = max(_FP32_MODEL * num_gpus_per_node, host)
        cpu_mem = total_params * host * additional_buffer_factor
    else:
        shard_state = b + _master_bytes(b) + _SHARD_GRAD + _ADAM_STATE
        gpu_mem = largest_layer_memory + int(shard_state * total_params / world)
        built = largest_layer_params if zero_init else total_params
        cpu_mem = built * _FP32_MODEL * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), int(largest_layer_memory)


def estimate_zero3_model_states_mem_needs_all_live(
    model, num_gpus_per_node=1, num_nodes=1, additional_buffer_factor=1.5, *, dtype=torch.float16
):
    """Prints the ZeRO-3 estimates for every offload and ``zero_init`` option for ``model``:
    its parameters counted once each (ZeRO-3 ones whole), its largest layer the module with the
    most parameters of its own."""
    total_params, largest_layer_params = _total_and_largest_layer(model)
    estimate_zero3_model_states_mem_needs_all_cold(
        total_params,
        largest_layer_params,
        num_gpus_per_node=num_gpus_per_node,
        num_nodes=num_nodes,
        additional_buffer_factor=additional_buffer_factor,
        dtype=dtype,
    )


def estimate_zero3_model_states_mem_needs_all_cold(
    total_params,
    largest_layer_params,
    num_gpus_per_node=1,
    num_nodes=1,
    additional_buffer_factor=1.5,
    *,
    dtype=torch.float16,
):
    """Prints the ZeRO-3 estimates for every offload and ``zero_init`` option for a model of
    ``total_params`` parameters whose largest layer has ``largest_layer_params``."""
    _check_world(num_gpus_per_node, num_nodes)
    _header(
        num_gpus_per_node,
        num_nodes,
        f"{int(total_params / 1e6)}M total params, "
        f"{int(largest_layer_params / 1e6)}M largest layer params",
    )
    for cpu_offload, cpu_offload_params in ((True, True), (True, False), (False, False)):
        for zero_init in (True, False):
            cpu_mem, gpu_mem, _ = estimate_zero3_model_states_mem_needs(
                total_params,
                largest_layer_params,
                num_gpus_per_node,
                num_nodes,
                cpu_offload=cpu_offload,
                cpu_offload_params=cpu_offload_params,
                zero_init=zero_init,
                additional_buffer_factor=additional_buffer_factor,
                dtype=dtype,
            )
            options = (
                f"offload_param={_device(cpu_offload_params)}, "
                f"offload_optimizer={_device(cpu_offload)}, zero_init={int(zero_init)}"
            )
            _row(cpu_mem, gpu_mem, options)
