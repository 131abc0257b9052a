"""``deepspeed.checkpointing`` (issue 28): recomputation that reproduces dropout exactly, the RNG
tracker's model-parallel seeds, saved inputs partitioned across a model-parallel group or kept on
the host, and the config's ``activation_checkpointing`` section applied by ``initialize``.

References are independent of the code under test: the same model run without checkpointing
(bitwise equal, fp32, dropout on), torch generators seeded by hand for the tracker's streams.
Multi-rank checks run on the module's pool of 2 real gloo processes, several per launch.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.distributed as dist

import deepspeed_cpp
import deepspeed_cpp.checkpointing as checkpointing
from deepspeed_cpp.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

WIDTH, BLOCKS, MICRO = 12, 3, 3


class Block(torch.nn.Module):
    """Dropout from the default generator and, in the "model-parallel region", from the
    tracker's forked state; ``scale`` arrives by keyword."""

    def __init__(self, tracker_dropout: bool = True):
        super().__init__()
        self.inner = torch.nn.Linear(WIDTH, WIDTH)
        self.outer = torch.nn.Linear(WIDTH, WIDTH)
        self.tracker_dropout = tracker_dropout

    def forward(self, x, scale=None):
        h = torch.nn.functional.dropout(torch.tanh(self.inner(x)), 0.3)
        if self.tracker_dropout:
            with checkpointing.get_cuda_rng_tracker().fork():
                h = torch.nn.functional.dropout(h, 0.4)
        h = x + self.outer(h)
        return h * scale if scale is not None else h


class Net(torch.nn.Module):
    def __init__(self, use_checkpoint: bool, tracker_dropout: bool = True):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(tracker_dropout) for _ in range(BLOCKS))
        self.head = torch.nn.Linear(WIDTH, 2)
        self.use_checkpoint = use_checkpoint

    def forward(self, x):
        scale = torch.full((WIDTH,), 0.9)
        for block in self.blocks:
            if self.use_checkpoint:
                x = checkpointing.checkpoint(block, x, scale=scale)
            else:
                x = block(x, scale=scale)
        return self.head(x)


def _restore_defaults() -> None:
    """Back to an unconfigured module (the pool's processes outlive each test)."""
    checkpointing.mpu = None
    checkpointing.configure(None)
    checkpointing.mp_rank, checkpointing.mp_size, checkpointing.mp_group = 0, 1, None
    checkpointing.deepspeed_checkpointing_enabled = False
    checkpointing._configured_by = None
    checkpointing.reset()


@pytest.fixture
def unconfigured():
    _restore_defaults()
    yield
    _restore_defaults()


def _seed() -> int:
    return int(torch.randint(0, 2**30, (1,)))


# --- one process -------------------------------------------------------------------------------


def _train_plain_loop(use_checkpoint: bool, seed: int, steps: int = 3):
    torch.manual_seed(seed)
    checkpointing.model_parallel_cuda_manual_seed(seed)
    model = Net(use_checkpoint)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        # The input does not require grad: the parameters' gradients must still arrive.
        x = torch.randn(MICRO, WIDTH, generator=data)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    tracker = checkpointing.get_cuda_rng_tracker().get_states()
    return [p.detach().clone() for p in model.parameters()], torch.get_rng_state(), tracker


def test_recomputation_reproduces_dropout_bitwise(unconfigured):
    seed = _seed()
    plain = _train_plain_loop(False, seed)
    checkpointed = _train_plain_loop(True, seed)
    for expected, got in zip(plain[0], checkpointed[0]):
        assert torch.equal(expected, got)
    # The recomputation leaves every generator where the plain run leaves it.
    assert torch.equal(plain[1], checkpointed[1])
    assert plain[2].keys() == checkpointed[2].keys()
    assert all(torch.equal(plain[2][k], checkpointed[2][k]) for k in plain[2])


def test_cpu_checkpointing_sends_saved_inputs_through_the_host_path(unconfigured, caplog):
    seed = _seed()
    plain = _train_plain_loop(False, seed, steps=2)
    checkpointing.configure(None, checkpoint_in_cpu=True, synchronize=True, profile=True)
    with caplog.at_level(logging.INFO, logger="deepspeed_cpp"):
        checkpointed = _train_plain_loop(True, seed, steps=2)
    timings = [r.getMessage() for r in caplog.records if "activation checkpoint " in r.getMessage()]
    assert sum("checkpoint forward:" in m for m in timings) == BLOCKS * 2
    assert sum("checkpoint recomputation:" in m for m in timings) == BLOCKS * 2
    for expected, got in zip(plain[0], checkpointed[0]):
        assert torch.equal(expected, got)
    stats = checkpointing.saved_input_stats()
    # Per checkpointed call two float inputs (x, scale), over 3 blocks and 2 steps; all rebuilt.
    assert stats.host_copies == stats.packed == stats.unpacked == 2 * BLOCKS * 2
    assert stats.partitioned == 0
    assert stats.kept_bytes == 2 * BLOCKS * (MICRO * WIDTH + WIDTH) * 4


def test_deepspeed_return_shapes_keywords_and_non_tensors(unconfigured):
    weight = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(4, requires_grad=True)
    mask = torch.rand(4) > 0.5

    def function(value, flag, mask, *, offset):
        out = (weight @ value) * mask + offset
        return (out, flag, mask)

    out, flag, got_mask = checkpointing.checkpoint(function, x, "kept", mask, offset=x)
    assert flag == "kept" and torch.equal(got_mask, mask)
    out.sum().backward()
    reference_weight = weight.detach().clone().requires_grad_()
    reference_x = x.detach().clone().requires_grad_()
    ((reference_weight @ reference_x) * mask + reference_x).sum().backward()
    assert torch.equal(weight.grad, reference_weight.grad)
    assert torch.equal(x.grad, reference_x.grad)
    # DeepSpeed unwraps a single output from its sequence.
    single = checkpointing.checkpoint(lambda v: [v * 2], x)
    assert torch.is_tensor(single) and torch.equal(single, x * 2)
    # Under no_grad it is a plain call.
    with torch.no_grad():
        assert torch.equal(checkpointing.checkpoint(lambda v: v + 1, x), x + 1)


def test_tracker_fork_add_and_seeds_follow_deepspeeds_definition(unconfigured):
    seed = _seed() % 2**20

    class TensorParallelRank:
        def __init__(self, rank):
            self.rank = rank

        def get_tensor_model_parallel_rank(self):
            return self.rank

    streams = []
    for tp_rank in (0, 1):
        checkpointing.mpu = TensorParallelRank(tp_rank)
        checkpointing.model_parallel_cuda_manual_seed(seed)
        default = torch.rand(64)
        tracker = checkpointing.get_cuda_rng_tracker()
        with tracker.fork():
            first = torch.rand(64)
        after_fork = torch.rand(64)
        with tracker.fork():
            second = torch.rand(64)
        # DeepSpeed's fact (deepspeed/runtime/activation_checkpointing/checkpointing.py):
        # default generator <- seed, model-parallel state <- seed + 2718 + tensor-parallel rank.
        expected_default = torch.Generator().manual_seed(seed)
        expected_forked = torch.Generator().manual_seed(seed + 2718 + tp_rank)
        assert torch.equal(default, torch.rand(64, generator=expected_default))
        assert torch.equal(after_fork, torch.rand(64, generator=expected_default))
        assert torch.equal(first, torch.rand(64, generator=expected_forked))
        assert torch.equal(second, torch.rand(64, generator=expected_forked))
        streams.append((default, first))
    assert torch.equal(streams[0][0], streams[1][0])  # data-parallel stream: same on each rank
    assert not torch.equal(streams[0][1], streams[1][1])  # model-parallel: differs

    tracker = checkpointing.CudaRNGStatesTracker()
    tracker.add("a", seed)
    with pytest.raises(checkpointing.RNGStateError, match=f"seed {seed} is already tracked"):
        tracker.add("b", seed)
    with pytest.raises(checkpointing.RNGStateError, match="'a' is already tracked"):
        tracker.add("a", seed + 1)
    with pytest.raises(checkpointing.RNGStateError, match="'missing'.*tracked: \\['a'\\]"):
        with tracker.fork("missing"):
            pass
    saved = tracker.get_states()
    with tracker.fork("a"):
        drawn = torch.rand(8)
    tracker.set_states(saved)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(8), drawn)


def test_bad_input_is_named(unconfigured):
    with pytest.raises(TypeError, match="unexpected keyword argument 'partition'"):
        checkpointing.configure(None, partition=True)
    with pytest.raises(ValueError, match="checkpoint_in_cpu='yes'"):
        checkpointing.configure(None, checkpoint_in_cpu="yes")
    with pytest.raises(ValueError, match="num_checkpoints=0"):
        checkpointing.configure(None, num_checkpoints=0)
    # DeepSpeed raises AssertionError for these two; ours is also one.
    with pytest.raises(AssertionError, match="number of layers"):
        checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True)
    with pytest.raises(AssertionError, match="partition_activations"):
        checkpointing.configure(None, contiguous_checkpointing=True, num_checkpoints=2)
    assert not checkpointing.is_configured()  # a refused configuration changes nothing
    with pytest.raises(TypeError, match="expected a callable .* got Tensor"):
        checkpointing.checkpoint(torch.ones(2), torch.ones(2))
    with pytest.raises(ValueError, match="mpu_=object object"):
        checkpointing.configure(object())
    assert checkpointing.mpu is None and not checkpointing.is_configured()
    with pytest.raises(TypeError, match="seed='1'"):
        checkpointing.model_parallel_cuda_manual_seed("1")


def test_config_section_is_typed_and_checked(unconfigured, tmp_path):
    section = {
        "partition_activations": True,
        "contiguous_memory_optimization": True,
        "cpu_checkpointing": True,
        "number_checkpoints": 4,
        "synchronize_checkpoint_boundary": True,
        "profile": True,
    }
    config = {"train_batch_size": 2, "activation_checkpointing": section}
    parsed = DeepSpeedConfig.parse(config).activation_checkpointing
    assert parsed.model_dump() == section
    assert DeepSpeedConfig.parse({"train_batch_size": 2}).activation_checkpointing is None
    with pytest.raises(DeepSpeedConfigError, match="activation_checkpointing.profile"):
        DeepSpeedConfig.parse({"activation_checkpointing": {"profile": 1}})
    with pytest.raises(DeepSpeedConfigError, match="partition_activation"):
        DeepSpeedConfig.parse({"activation_checkpointing": {"partition_activation": True}})
    with pytest.raises(DeepSpeedConfigError, match="needs number_checkpoints"):
        DeepSpeedConfig.parse(
            {
                "activation_checkpointing": {
                    "partition_activations": True,
                    "contiguous_memory_optimization": True,
                }
            }
        )
    # configure(deepspeed_config=path) reads the section; arguments override it.
    path = tmp_path / "ds_config.json"
    path.write_text(__import__("json").dumps(config))
    checkpointing.configure(None, deepspeed_config=str(path), profile=False)
    assert checkpointing.PARTITION_ACTIVATIONS and checkpointing.CONTIGUOUS_CHECKPOINTING
    assert checkpointing.CPU_CHECKPOINT and checkpointing.SYNCHRONIZE
    assert checkpointing.num_layers == 4 and not checkpointing.PROFILE_TIME
    assert checkpointing.is_configured()


# --- real gloo ranks ---------------------------------------------------------------------------


def engine_job(stage: int, seed: int, steps: int):
    """The same dropout model trained by the engine without and with checkpointing (the second
    with an activation_checkpointing section, applied by initialize); each rank its own data."""
    rank = dist.get_rank()
    results = {}
    for use_checkpoint in (False, True):
        _restore_defaults()
        torch.manual_seed(seed)
        model = Net(use_checkpoint)
        config = {
            "gradient_clipping": 0.0,
            "train_micro_batch_size_per_gpu": MICRO,
            "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }
        if use_checkpoint:
            # No mpu: partition_activations is a logged no-op; cpu_checkpointing runs the
            # host path (a no-op copy on the CPU, but every saved input goes through it).
            config["activation_checkpointing"] = {
                "partition_activations": True,
                "cpu_checkpointing": True,
                "profile": stage == 0,
            }
        engine, *_ = deepspeed_cpp.initialize(model=model, config=config)
        # Different dropout streams on each rank, equal between the two runs.
        checkpointing.model_parallel_cuda_manual_seed(seed + 100 * rank)
        data = torch.Generator().manual_seed(seed + 1 + rank)
        for _ in range(steps):
            x = torch.randn(MICRO, WIDTH, generator=data)
            engine.backward(engine(x).square().mean())
            engine.step()
        results[use_checkpoint] = {
            "params": {k: v.clone() for k, v in engine.full_module_state_dict().items()},
            "configured": checkpointing.is_configured(),
            "flags": (checkpointing.PARTITION_ACTIVATIONS, checkpointing.CPU_CHECKPOINT),
            "stats": checkpointing.saved_input_stats(),
        }
        engine.destroy()
    _restore_defaults()
    return results


@pytest.mark.parametrize("stage", [0, 3])
def test_engine_training_through_checkpoint_is_bitwise_equal(pool2, stage):
    steps = 3
    for rank_result in pool2.run(engine_job, stage, _seed(), steps):
        plain, checkpointed = rank_result[False], rank_result[True]
        assert plain["configured"] is False
        assert checkpointed["configured"] is True and checkpointed["flags"] == (True, True)
        assert plain["params"].keys() == checkpointed["params"].keys()
        for name, expected in plain["params"].items():
            assert torch.equal(expected, checkpointed["params"][name]), name
        stats = checkpointed["stats"]
        assert stats.partitioned == 0  # no model-parallel group
        assert stats.host_copies == stats.unpacked == 2 * BLOCKS * steps


class GroupMPU:
    """The mpu DeepSpeed expects, over a real process group of both ranks."""

    def __init__(self):
        self.group = dist.new_group([0, 1])

    def get_model_parallel_rank(self):
        return dist.get_rank(self.group)

    def get_model_parallel_world_size(self):
        return dist.get_world_size(self.group)

    def get_model_parallel_group(self):
        return self.group


ODD = (5, 7)  # 35 elements: partitions of 18, the last one padded


def _grads_through_odd_blocks(seed: int, use_checkpoint: bool):
    """Gradients of a model whose checkpointed inputs have an odd element count; the same data
    and dropout on both ranks (their inputs are replicated, as under tensor parallelism)."""
    torch.manual_seed(seed)
    blocks = torch.nn.ModuleList(torch.nn.Linear(ODD[1], ODD[1]) for _ in range(BLOCKS))
    x = torch.randn(*ODD)
    for block in blocks:
        step = lambda h, b=block: torch.nn.functional.dropout(torch.tanh(b(h)), 0.25)  # noqa: E731
        x = checkpointing.checkpoint(step, x) if use_checkpoint else step(x)
    x.square().sum().backward()
    return [p.grad.clone() for p in blocks.parameters()]


def model_parallel_job(seed: int):
    _restore_defaults()
    mpu = GroupMPU()
    result = {"plain": _grads_through_odd_blocks(seed, False)}
    checkpointing.configure(mpu, partition_activations=True)
    result["partitioned"] = _grads_through_odd_blocks(seed, True)
    result["partitioned_stats"] = checkpointing.saved_input_stats()
    checkpointing.reset()
    checkpointing.configure(
        mpu, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=BLOCKS
    )
    result["contiguous"] = _grads_through_odd_blocks(seed, True)
    result["contiguous_stats"] = checkpointing.saved_input_stats()
    checkpointing.reset()
    # Seeds through the configured mpu: forked masks differ between the two ranks.
    checkpointing.model_parallel_cuda_manual_seed(seed % 2**20)
    result["default_draw"] = torch.rand(32)
    with checkpointing.get_cuda_rng_tracker().fork():
        result["forked_draw"] = torch.rand(32)
    _restore_defaults()
    return result


def test_partitioned_activations_over_a_model_parallel_group(pool2):
    seed = _seed()
    results = pool2.run(model_parallel_job, seed)
    share_bytes = math.ceil(ODD[0] * ODD[1] / 2) * 4
    for rank, result in enumerate(results):
        for variant in ("partitioned", "contiguous"):
            for expected, got in zip(result["plain"], result[variant]):
                assert torch.equal(expected, got), (rank, variant)
            stats = result[f"{variant}_stats"]
            assert stats.partitioned == stats.unpacked == BLOCKS
            assert stats.kept_bytes == BLOCKS * share_bytes  # half of each input, padded
            assert stats.host_copies == 0
        expected_forked = torch.Generator().manual_seed(seed % 2**20 + 2718 + rank)
        assert torch.equal(result["forked_draw"], torch.rand(32, generator=expected_forked))
    assert torch.equal(results[0]["default_draw"], results[1]["default_draw"])
    assert not torch.equal(results[0]["forked_draw"], results[1]["forked_draw"])
