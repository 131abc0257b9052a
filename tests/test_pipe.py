"""Pipeline parallelism (deepspeed.pipe) on real gloo ranks: 2 stages trained with 1F1B equal the
same model trained in one process on the same global batches."""

from __future__ import annotations

import random

import pipe_jobs as jobs
import pytest

from deepspeed_cpp.runtime.layer_partitions import partition_balanced, partition_uniform
from deepspeed_cpp.runtime.pipe import schedule
from deepspeed_cpp.runtime.pipe.topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
)


def test_topology_rank_layout_is_deepspeeds():
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert topo.get_axis_names() == ["pipe", "data", "model"]
    assert topo.get_rank(pipe=1, data=0, model=1) == 5
    assert topo.get_coord(6) == topo.ProcessCoord(pipe=1, data=1, model=0)
    assert topo.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.get_axis_comm_lists("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.get_axis_comm_lists("tensor") == []
    assert topo.filter_match(pipe=0, data=1) == [2, 3]
    assert topo.get_rank_repr(5) == "model_01"
    assert topo.get_rank_repr(5, omit_axes=["data"]) == "pipe_01-model_01"
    pd = PipeDataParallelTopology(num_pp=2, num_dp=3)
    assert pd.get_axis_list("pipe", 1) == [3, 4, 5] and pd.get_dim("model") == 0
    assert pd.world_size() == 6
    with pytest.raises(ValueError, match="one coordinate per axis"):
        pd.get_rank(pipe=0)
    with pytest.raises(ValueError, match="dims"):
        ProcessTopology(["a", "b"], [2])


def test_partitions_match_deepspeeds_rules():
    assert partition_uniform(10, 3) == [0, 4, 7, 10]
    assert partition_uniform(2, 3) == [0, 1, 2, 2]
    assert partition_balanced([5, 1, 1, 1, 1, 1], 2) == [0, 1, 6]
    assert partition_balanced([1, 1, 1, 1], 2) == [0, 2, 4]
    weights = [random.randint(0, 9) for _ in range(12)]
    bounds = partition_balanced(weights, 3)
    sums = [sum(weights[bounds[i] : bounds[i + 1]]) for i in range(3)]
    # No split into 3 contiguous non-empty parts is more even (exhaustive check).
    best = min(
        max(s) - min(s)
        for a in range(1, 11)
        for b in range(a + 1, 12)
        for s in [[sum(weights[:a]), sum(weights[a:b]), sum(weights[b:])]]
    )
    assert max(sums) - min(sums) == best and all(bounds[i] < bounds[i + 1] for i in range(3))


@pytest.mark.parametrize("stages,micro_batches", [(2, 4), (4, 3), (3, 1)])
def test_train_schedule_is_1f1b(stages, micro_batches):
    for stage in range(stages):
        sched = schedule.TrainSchedule(micro_batches, stages, stage)
        flat = [i for step in sched.steps() for i in step]
        forwards = [i.buffer_id for i in flat if isinstance(i, schedule.ForwardPass)]
        backwards = [i for i in flat if isinstance(i, schedule.BackwardPass)]
        assert len(forwards) == len(backwards) == micro_batches
        # At most stages - stage activations live at once.
        live, peak = 0, 0
        for instruction in flat:
            live += isinstance(instruction, schedule.ForwardPass)
            live -= isinstance(instruction, schedule.BackwardPass)
            peak = max(peak, live)
        assert peak == min(stages - stage, micro_batches)
        assert flat[-3:] == [schedule.ReduceTiedGrads(), schedule.ReduceGrads(),
                             schedule.OptimizerStep()]  # fmt: skip
        assert any(isinstance(i, schedule.RecvActivation) for i in flat) == (stage > 0)
        assert any(isinstance(i, schedule.SendGrad) for i in flat) == (stage > 0)
        assert any(isinstance(i, schedule.RecvGrad) for i in flat) == (stage < stages - 1)


@pytest.mark.parametrize("tied,clip", [(False, 0.0), (True, 0.05)])
def test_two_stages_train_like_one_process(pool2, tied, clip):
    seed = random.randrange(2**31)
    results = pool2.run(jobs.train_equals_one_process, seed, 3, 4, tied, clip, 0)
    for result in results:
        assert result["start"] == 0.0, result
        assert result["moved"] > 1e-3, result  # training changed the weights
        for key in ("loss", "params", "eval", "logits"):
            assert result[key] < 1e-6, (key, result)
        assert result["lr"] == pytest.approx(result["ref_lr"])
    names = [set(r["names"]) for r in results]
    assert not (names[0] - {"tied_modules.embed.weight"}) & names[1]  # stages hold other layers
    assert (
        "tied_modules.embed.weight" in names[0] and "tied_modules.embed.weight" in names[1]
    ) == tied


def test_bad_input_is_named(pool2):
    for errors in pool2.run(jobs.bad_input_errors):
        assert "num_stages (3) must" in errors["stages_not_dividing"]
        assert "1 layers but 2 stages" in errors["more_stages_than_layers"]
        assert "'Conv'" in errors["partition_no_match"]
        assert "'random' is not one of" in errors["partition_unknown"]
        assert errors["partition_profile"].startswith("UnsupportedPartitionMethod: ")
        assert "partition_method='profile'" in errors["partition_profile"]
        assert "nn.Module subclass" in errors["layerspec_not_module"]
        assert "zero_optimization.stage 2" in errors["zero2"]
        assert "pipeline.stages is 4 but the PipelineModule has 2 stages" in errors["config_stages"]
        for name in ("forward", "backward", "step"):
            assert f"PipelineEngine.{name}() is not available" in errors[name]
        assert "DataIteratorExhaustedError" in errors["exhausted"]
        assert "ran out after 1 of the 2 micro-batches" in errors["exhausted"]
        assert errors["exhausted_stage0"].startswith(
            "DataIteratorExhaustedError: the data iterator of rank 0 (stage 0) ran out after 1 "
            "of the 2 micro-batches"
        ), errors["exhausted_stage0"]
        assert errors["after"].startswith("loss ")
        assert "train_batch() is the pipeline engine's" in errors["train_batch_plain"]


def test_activation_checkpointing_with_dropout_is_bitwise_the_same(pool2):
    for result in pool2.run(jobs.checkpointing_changes_nothing, random.randrange(2**31), 2):
        assert result["same_start"] and result["moved"] > 1e-3, result
        assert result["same_end"], result
        assert result["losses"][0] == result["losses"][1]


def test_two_stages_two_replicas_zero1_train_like_one_process(pool4):
    seed = random.randrange(2**31)
    results = pool4.run(jobs.train_equals_one_process, seed, 3, 2, True, 0.05, 1)
    for result in results:
        assert result["start"] == 0.0 and result["moved"] > 1e-3, result
        for key in ("loss", "params", "eval", "logits"):
            assert result[key] < 1e-6, (key, result)
    assert [r["stage"] for r in results] == [0, 0, 1, 1]  # data is the fastest axis


def test_two_stages_two_tensor_slices_clip_on_the_whole_models_norm(pool4):
    """Two stages x two tensor-parallel slices whose layers are not split (replicated, as a
    TP stage's layer norms are): each replicated parameter counts once in the clipping norm,
    on slice 0 (it counted on every slice, clipping harder than the reference)."""
    seed = random.randrange(2**31)
    results = pool4.run(jobs.train_equals_one_process, seed, 3, 2, True, 0.05, 0, 2, 2)
    for result in results:
        assert result["start"] == 0.0 and result["moved"] > 1e-3, result
        for key in ("loss", "params", "eval", "logits"):
            assert result[key] < 1e-6, (key, result)
    assert [r["stage"] for r in results] == [0, 0, 1, 1]  # the slice is the fastest axis


def test_checkpoint_resumes_bitwise_and_loads_at_one_stage(pool2, tmp_path):
    from pathlib import Path

    seed = random.randrange(2**31)
    results = pool2.run(jobs.checkpoint_resume, seed, str(tmp_path / "a"), 2)
    for result in results:
        assert result["path_ok"] and result["client"] == {"epoch": 7} and result["steps"] == 2
        assert result["loaded_bitwise"] and result["resumed_bitwise"], result
        assert result["fp32_bitwise"], result
        assert "pipeline checkpoint (saved by a PipelineEngine, 2 stages" in result["plain_error"]
    # zero_to_fp32 holds every stage's weights under the PipelineModule's names.
    assert results[0]["fp32_names"] == sorted(set(results[0]["names"]) | set(results[1]["names"]))
    tag = Path(tmp_path / "a" / "global_step2")
    names = sorted(p.name for p in tag.iterdir())
    assert "layer_00-model_states.pt" in names and "mp_rank_01_model_states.pt" in names
    assert (tmp_path / "a" / "zero_to_fp32.py").is_file()  # the recovery script, as DeepSpeed
    assert "zero_pp_rank_0_mp_rank_01_optim_states.pt" in names
    damaged = tag / "layer_03-model_states.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    for error in pool2.run(jobs.load_error, seed, str(tmp_path / "a")):
        assert "layer_03-model_states.pt" in error, error
    results = pool2.run(jobs.checkpoint_resume, seed, str(tmp_path / "b"), 1)
    for result in results:
        assert result["client"] == {"epoch": 7} and result["steps"] == 2, result
        assert result["loaded_diff"] < 1e-6 and result["eval_diff"] < 1e-6, result
        assert result["adam_steps"] == [2], result  # the optimizer state came with the weights
        assert result["resumed_diff"] < 1e-6, result


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_matches_one_process(pool2, tmp_path, precision):
    seed = random.randrange(2**31)
    job = jobs.half_precision_equals_one_process
    for result in pool2.run(job, seed, 3, 3, str(tmp_path), precision):
        # zero_to_fp32 of the pipeline checkpoint: every stage's fp32 masters (the reference's,
        # to float32 rounding of the same Adam step).
        assert result["fp32_names"] and result["fp32_dtypes"] == ["torch.float32"], result
        assert result["fp32_not_widened"] and result["fp32_diff"] < 1e-6, result
        dtype = "torch.bfloat16" if precision == "bf16" else "torch.float16"
        assert result["dtypes"] == [dtype] and result["moved"] > 1e-3, result
        # The forward and backward are the reference's own half operations and the float32
        # sums run in the same order, so only the masters' Adam step may differ (~1e-7
        # relative), which can round a weight to the neighbouring half value: 1 unit at most.
        assert result["ulps"] <= 1.0, result
        # fp16 with its loss scale: the same, the scale 2^8 kept (no overflow), its units finer.
        mantissa = 7 if precision == "bf16" else 10
        assert result["loss_ratio"] <= 2**-mantissa, result  # an output's rounding, at most
        assert result["loss_scale"] == (None if precision == "bf16" else 2.0**8), result


def test_fp16_overflow_skips_every_stage(pool2):
    seed = random.randrange(2**31)
    results = pool2.run(jobs.fp16_overflow_skips_every_stage, seed)
    for result in results:
        assert result["dtypes"] == ["torch.float16"], result
        assert result["changed"] == [True, False, True], result
        assert result["skipped"] == 1 and result["steps"] == 3, result
        assert result["scales"] == [2.0**8, 2.0**7, 2.0**7], result


def test_one_replica_fast_path_is_bitwise_one_process(pool2):
    import pipe_flat_grads_jobs

    seed = random.randrange(2**31)
    results = pool2.run(pipe_flat_grads_jobs.trains_bitwise_like_one_process, seed, 3, 3)
    for result in results:
        assert result["grads_in_flat"] and result["one_state_per_master"], result
        assert result["weights_equal"] and result["moments_equal"], result
        assert result["moved"] > 1e-4, result
    assert results[0]["chunked"]  # stage 0's master is stepped in more than one chunk


def test_three_stages_train_like_one_process(pool3):
    # Tied weights on stages 0 and 2 (their tie group skips stage 1), clipping at 0.05.
    seed = random.randrange(2**31)
    results = pool3.run(jobs.train_equals_one_process, seed, 3, 4, True, 0.05, 0, 3)
    for result in results:
        assert result["start"] == 0.0 and result["moved"] > 1e-3, result
        for key in ("loss", "params", "eval", "logits"):
            assert result[key] < 1e-6, (key, result)
    assert [r["stage"] for r in results] == [0, 1, 2]
    names = [set(r["names"]) for r in results]
    assert all("tied_modules.embed.weight" in names[s] for s in (0, 2)), names
    assert "tied_modules.embed.weight" not in names[1] and names[1], names


@pytest.mark.parametrize("saved, resumed", [(2, 3), (3, 2)])
def test_checkpoint_resumes_at_another_number_of_stages(pool2, pool3, tmp_path, saved, resumed):
    """Saved at 2 stages, resumed at 3 (and back): the layers move between stages, with their
    Adam state (optimizer_reshard.py), tied weights on the first and last stage; the 2 steps
    after the load equal the uninterrupted run within 1e-6."""
    import pipe_reshard_jobs

    pools = {2: pool2, 3: pool3}
    seed = random.randrange(2**31)
    directory = str(tmp_path / "ckpt")
    first = pools[saved].run(pipe_reshard_jobs.save_then_continue, seed, directory, saved)
    uninterrupted = {k: v for result in first for k, v in result["state"].items()}
    results = pools[resumed].run(
        pipe_reshard_jobs.resume_and_compare, seed, directory, resumed, uninterrupted
    )
    assert [r["stage"] for r in results] == list(range(resumed))
    assert set().union(*(r["names"] for r in results)) == set(uninterrupted)
    for result in results:
        assert result["global_steps"] == 4 and result["adam_steps"] == [4], result
        assert result["diff"] < 1e-6, result
        assert abs(result["loss"] - first[-1]["loss"]) < 1e-6, result
