"""Jobs for test_model_parallel.py, run on every rank of a real gloo pool: ``initialize(mpu=...)``
with a Megatron-style mpu (model-parallel groups of consecutive ranks, data-parallel groups of
ranks with the same model-parallel index) built from ``dist.new_group``.

Each model-parallel index m holds another part of one model: a ``split`` layer of its own width
and initialisation (marked ``model_parallel``, as DeepSpeed's tensor-parallel layers are) and a
``shared`` layer replicated on every rank. The reference trains the whole model (``shared`` once,
every ``split_m``) in one process with torch.optim.AdamW on the data-parallel global batch,
clipping by the norm of the whole model's gradient.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

IN, MICRO, GAS, STEPS = 6, 2, 2, 3
LR, WEIGHT_DECAY, BETAS, EPS = 1e-2, 0.05, (0.9, 0.99), 1e-6
CLIP = 0.05  # well below the gradient norms here: clipping acts at every step


def split_width(mp_index: int) -> int:
    return 3 + 2 * mp_index


class PartNet(torch.nn.Module):
    """Model-parallel index ``mp_index``'s part: the replicated ``shared`` layer and its own
    ``split`` layer; the loss is the sum of both layers' losses."""

    def __init__(self, mp_index: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)  # the same replicated layer on every rank
        self.shared = torch.nn.Linear(IN, IN)
        torch.manual_seed(seed + 1000 + mp_index)  # another part on each model-parallel index
        self.split = torch.nn.Linear(IN, split_width(mp_index))
        for param in self.split.parameters():
            param.model_parallel = True

    def forward(self, x, target, y):
        shared = torch.nn.functional.mse_loss(self.shared(x), target)
        return shared + torch.nn.functional.mse_loss(self.split(torch.tanh(x)), y)


class PairMpu:
    """DeepSpeed's mpu protocol over ``dist.new_group`` groups: model-parallel groups are
    ``[i * mp, (i + 1) * mp)``, data-parallel groups the ranks equal modulo ``mp``."""

    def __init__(self, mp_size: int):
        world, rank = dist.get_world_size(), dist.get_rank()
        for i in range(world // mp_size):
            ranks = list(range(i * mp_size, (i + 1) * mp_size))
            group = dist.new_group(ranks)
            if rank in ranks:
                self.mp_group, self.mp_rank, self.mp_size = group, ranks.index(rank), mp_size
        for j in range(mp_size):
            ranks = list(range(j, world, mp_size))
            group = dist.new_group(ranks)
            if rank in ranks:
                self.dp_group, self.dp_rank, self.dp_size = group, ranks.index(rank), len(ranks)

    def get_model_parallel_group(self):
        return self.mp_group

    def get_model_parallel_rank(self):
        return self.mp_rank

    def get_model_parallel_world_size(self):
        return self.mp_size

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_rank(self):
        return self.dp_rank

    def get_data_parallel_world_size(self):
        return self.dp_size


_MPUS: dict[int, PairMpu] = {}


def _mpu(mp_size: int) -> PairMpu:
    """One mpu per size and worker process (new_group is collective and not free)."""
    if mp_size not in _MPUS:
        _MPUS[mp_size] = PairMpu(mp_size)
    return _MPUS[mp_size]


def _batches(seed: int, dp_size: int, mp_size: int, steps: int):
    """Per step, per micro-step: the data-parallel global batch (x, target, y of every part's
    width side by side)."""
    generator = torch.Generator().manual_seed(seed + 7)
    size = MICRO * dp_size
    width = sum(split_width(m) for m in range(mp_size))
    return [
        [
            (
                torch.randn(size, IN, generator=generator),
                torch.randn(size, IN, generator=generator),
                torch.randn(size, width, generator=generator),
            )
            for _ in range(GAS)
        ]
        for _ in range(steps)
    ]


def _columns(mp_index: int) -> slice:
    start = sum(split_width(m) for m in range(mp_index))
    return slice(start, start + split_width(mp_index))


def _config(stage: int, clip: float = CLIP, extra: dict | None = None) -> dict:
    config = {
        "train_batch_size": None,  # set by the callers: the rule counts data-parallel ranks only
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": clip,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY},
        },
        # Small buckets: the replicated and the split layer share one, split between owners.
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 40},
    }
    for key, value in (extra or {}).items():  # {"bf16": {...}, "zero_optimization": {...}}
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


def reference(seed: int, dp_size: int, mp_size: int, steps: int, clip: float = CLIP):
    """The whole model trained in one process: per step the parameters of every part (the
    shared layer once, as part 0's) and the gradient norm before clipping."""
    parts = [PartNet(m, seed) for m in range(mp_size)]
    params = list(parts[0].shared.parameters())
    for part in parts:
        params += list(part.split.parameters())
    optimizer = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    norms, snapshots = [], []
    for micro_batches in _batches(seed, dp_size, mp_size, steps):
        for x, target, y in micro_batches:
            loss = torch.nn.functional.mse_loss(parts[0].shared(x), target)
            for m, part in enumerate(parts):
                loss = loss + torch.nn.functional.mse_loss(
                    part.split(torch.tanh(x)), y[:, _columns(m)]
                )
            (loss / GAS).backward()
        norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in params)).item()
        norms.append(norm)
        coefficient = clip / (norm + 1e-6) if clip > 0 else 1.0
        if coefficient < 1.0:
            for p in params:
                p.grad.mul_(coefficient)
        optimizer.step()
        optimizer.zero_grad()
        snapshots.append(
            [{n: p.detach().clone() for n, p in _part_params(part, parts[0])} for part in parts]
        )
    return norms, snapshots


def _part_params(part: PartNet, holder_of_shared: PartNet):
    """``part``'s parameters by name, its shared layer's values read from the reference's one
    copy (``holder_of_shared``)."""
    for name, param in part.named_parameters():
        if name.startswith("shared."):
            param = holder_of_shared.get_parameter(name)
        yield name, param


def _train(engine, seed: int, mpu: PairMpu, steps: int, first_step: int = 0):
    """Trains ``engine`` on this rank's share of the global batches of steps
    ``first_step .. steps - 1``; per step the parameters and the engine's gradient norm."""
    mp_size = mpu.get_model_parallel_world_size()
    dp_rank, dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    rows = slice(dp_rank * MICRO, (dp_rank + 1) * MICRO)
    columns = _columns(mpu.get_model_parallel_rank())
    out = []
    dtype = next(engine.module.parameters()).dtype  # bf16 / fp16 engines take their dtype
    for micro_batches in _batches(seed, dp_size, mp_size, steps)[first_step:]:
        for x, target, y in micro_batches:
            x, target, y = (t.to(dtype) for t in (x, target, y[:, columns]))
            engine.backward(engine(x[rows], target[rows], y[rows]))
            engine.step()
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        out.append((params, engine.get_global_grad_norm()))
    return out


def _initialize(stage: int, seed: int, mpu: PairMpu, clip: float = CLIP, extra=None):
    import deepspeed_cpp as deepspeed

    config = _config(stage, clip, extra)
    config["train_batch_size"] = MICRO * GAS * mpu.get_data_parallel_world_size()
    model = PartNet(mpu.get_model_parallel_rank(), seed)
    engine, *_ = deepspeed.initialize(model=model, config=config, mpu=mpu)
    return engine


def _max_difference(ours: dict, reference: dict) -> float:
    assert ours.keys() == reference.keys(), (sorted(ours), sorted(reference))
    return max((ours[n] - reference[n]).abs().max().item() for n in ours)


def train_matches_reference(
    stage: int, mp_size: int, seed: int, clip: float = CLIP, extra: dict | None = None
) -> dict:
    """Trains this rank's part at ``stage`` with the mpu (``extra``: config sections added:
    precision, offload); returns the largest parameter and norm differences from the
    reference, what the engine and ``deepspeed.utils.groups`` report."""
    from deepspeed_cpp.utils import groups

    mpu = _mpu(mp_size)
    engine = _initialize(stage, seed, mpu, clip, extra)
    seen = {
        "engine": (engine.dp_rank, engine.dp_world_size, engine.mp_rank, engine.mp_world_size),
        "groups": (
            groups._get_data_parallel_rank(),
            groups._get_data_parallel_world_size(),
            groups._get_model_parallel_rank(),
            groups._get_model_parallel_world_size(),
            groups._get_broadcast_src_rank(),
        ),
        "train_batch_size": engine.train_batch_size(),
    }
    ours = _train(engine, seed, mpu, STEPS)
    engine.destroy()
    groups.set_model_parallel_unit(None)
    norms, snapshots = reference(seed, mpu.get_data_parallel_world_size(), mp_size, STEPS, clip)
    m = mpu.get_model_parallel_rank()
    ours = [({n: p.float() for n, p in params.items()}, norm) for params, norm in ours]
    return {
        **seen,
        "param_difference": max(
            _max_difference(params, snapshot[m]) for (params, _), snapshot in zip(ours, snapshots)
        ),
        "norms": [norm for _, norm in ours],
        "reference_norms": norms,
    }


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def checkpoint_round_trip(save_dir: str, stage: int, seed: int) -> dict:
    """Trains 2 steps, saves, trains a third; a new engine (another init) loads the save and
    trains the third step again: both bitwise equal. Then the model-parallel layout and the
    refusal at another model-parallel size."""
    from deepspeed_cpp.runtime.checkpoint import ModelParallelMismatchError
    from deepspeed_cpp.runtime.checkpoint.layout import model_parallel_dir
    from deepspeed_cpp.utils import groups

    mpu = _mpu(2)
    save_dir = os.path.join(save_dir, f"stage{stage}")
    engine = _initialize(stage, seed, mpu)
    saved = _train(engine, seed, mpu, 2)[-1][0]
    engine.save_checkpoint(save_dir, tag="two")
    continued = _train(engine, seed, mpu, 3, first_step=2)[-1][0]
    engine.destroy()

    fresh = _initialize(stage, seed + 1, mpu)
    differs_before = not _equal(
        {n: p.detach().clone() for n, p in fresh.module.named_parameters()}, saved
    )
    path, _ = fresh.load_checkpoint(save_dir)
    loaded = {n: p.detach().clone() for n, p in fresh.module.named_parameters()}
    resumed = _train(fresh, seed, mpu, 3, first_step=2)[-1][0]
    steps = fresh.global_steps
    fresh.destroy()
    groups.set_model_parallel_unit(None)

    refusals = []
    for mp_world_size in (1, 4):
        try:
            model_parallel_dir(save_dir, 0, mp_world_size, loading=True)
        except ModelParallelMismatchError as error:
            refusals.append(str(error))
    # An engine without model parallelism: these parts are not AutoTP's, nothing re-cuts them.
    import deepspeed_cpp as deepspeed

    config = _config(stage)
    config["train_batch_size"] = MICRO * GAS * dist.get_world_size()
    plain, *_ = deepspeed.initialize(model=PartNet(0, seed), config=config)
    try:
        plain.load_checkpoint(save_dir)
    except ModelParallelMismatchError as error:
        refusals.append(str(error))
    plain.destroy()
    return {
        "folders": sorted(os.listdir(save_dir)),
        "path": path,
        "differs_before": differs_before,
        "loaded_equal": _equal(loaded, saved),
        "resumed_equal": _equal(resumed, continued),
        "global_steps": steps,
        "refusals": refusals,
    }


def zero3_refused(seed: int) -> str:
    from deepspeed_cpp.utils import groups

    try:
        _initialize(3, seed, _mpu(2))
    except NotImplementedError as error:
        return str(error)
    finally:
        groups.set_model_parallel_unit(None)
    return "not refused"


def mp1_equals_no_mpu(stage: int, seed: int) -> bool:
    """Model-parallel size 1: the same training, bitwise, as without an mpu."""
    import deepspeed_cpp as deepspeed
    from deepspeed_cpp.utils import groups

    mpu = _mpu(1)
    with_mpu = _initialize(stage, seed, mpu)
    ours = _train(with_mpu, seed, mpu, STEPS)
    with_mpu.destroy()
    groups.set_model_parallel_unit(None)
    config = _config(stage)
    config["train_batch_size"] = MICRO * GAS * dist.get_world_size()
    plain, *_ = deepspeed.initialize(model=PartNet(0, seed), config=config)
    theirs = _train(plain, seed, mpu, STEPS)
    plain.destroy()
    return all(_equal(a, b) and na == nb for (a, na), (b, nb) in zip(ours, theirs))


def _count_backward_steps(engine) -> list[int]:
    """Per boundary ``engine.step()`` from now on: how many optimizer sub-groups were stepped
    during that step's backward (offload's ``step_during_backward``; stays [] without it)."""
    backward_steps = getattr(getattr(engine.optimizer, "stepper", None), "backward_steps", None)
    counts: list[int] = []
    if backward_steps is None:
        return counts
    step = engine.step

    def counting_step():
        if engine.is_gradient_accumulation_boundary():
            counts.append(backward_steps.stepped_count)
        return step()

    engine.step = counting_step
    return counts


def nonfinite_on_one_rank_skipped_everywhere(
    stage: int, seed: int, clip: float = CLIP, extra: dict | None = None, bad: float = math.nan
) -> dict:
    """A NaN (or ``bad``: inf, an fp16 overflow) in one rank's split-layer gradient (global
    rank 3: another model-parallel part than ranks 0 and 2) at step 1: every rank of the world
    skips that step (with ``extra`` config sections: precision, offload)."""
    from deepspeed_cpp.utils import groups

    mpu = _mpu(2)
    engine = _initialize(stage, seed, mpu, clip, extra)
    first = _train(engine, seed, mpu, 1)[-1][0]
    scale_before = engine.loss_scaler.cur_scale if engine.loss_scaler is not None else None
    handle = None
    if dist.get_rank() == 3:
        handle = engine.module.split.weight.register_hook(lambda g: g * bad)
    stepped_early = _count_backward_steps(engine)
    second = _train(engine, seed, mpu, 2, first_step=1)[-1][0]
    engine.__dict__.pop("step", None)  # counting_step's wrapper
    scale_after = engine.loss_scaler.cur_scale if engine.loss_scaler is not None else None
    if handle is not None:
        handle.remove()
    third = _train(engine, seed, mpu, 3, first_step=2)[-1][0]
    result = {
        "skipped_steps": engine.skipped_steps,
        "unchanged_by_skip": _equal(first, second),
        "trains_after": not _equal(second, third),
    }
    if scale_before is not None:
        result["loss_scales"] = (scale_before, scale_after)
    if stepped_early:
        result["stepped_early"] = stepped_early
    engine.destroy()
    groups.set_model_parallel_unit(None)
    return result


def bad_mpu_named() -> str:
    import deepspeed_cpp as deepspeed

    class HalfMpu:
        def get_data_parallel_group(self):
            return None

    try:
        deepspeed.initialize(model=PartNet(0, 1), config=_config(1), mpu=HalfMpu())
    except TypeError as error:
        return str(error)
    return "not refused"
