"""``initialize(mpu=...)`` at ZeRO 0, 1 and 2 on real gloo pools: 4 ranks as 2 model-parallel x
2 data-parallel, each model-parallel index training another part of one model, against the whole
model trained in one process (``model_parallel_jobs.py``); checkpoints per model-parallel rank;
and model-parallel size 1 on 2 ranks equal to no mpu at all. The same with bf16 and fp16 (loss
scaling; an overflow on one model-parallel rank skipped everywhere) and with the optimizer
offloaded to the host, with and without stepping sub-groups during backward."""

from __future__ import annotations

import model_parallel_jobs as jobs
import pytest

SEED = 20261127


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_two_by_two_trains_like_the_whole_model_in_one_process(pool4, stage):
    results = pool4.run(jobs.train_matches_reference, stage, 2, SEED + stage, timeout=300.0)
    for rank, result in enumerate(results):
        dp_rank, mp_rank = rank // 2, rank % 2
        assert result["engine"] == (dp_rank, 2, mp_rank, 2)
        assert result["groups"] == (dp_rank, 2, mp_rank, 2, mp_rank)
        assert result["train_batch_size"] == jobs.MICRO * jobs.GAS * 2
        assert result["param_difference"] <= 1e-6, (rank, result["param_difference"])
        # The whole model's norm (the replicated layer once) on every rank, above the clip.
        for ours, reference in zip(result["norms"], result["reference_norms"]):
            assert ours == pytest.approx(reference, rel=1e-6)
            assert reference > jobs.CLIP


@pytest.mark.parametrize("stage", [1, 2])
def test_checkpoint_per_model_parallel_rank_resumes_bitwise(pool4, tmp_path, stage):
    results = pool4.run(jobs.checkpoint_round_trip, str(tmp_path), stage, SEED, timeout=300.0)
    for rank, result in enumerate(results):
        assert result["folders"] == ["mp_rank_00", "mp_rank_01"]
        assert result["path"].endswith(f"mp_rank_{rank % 2:02d}/two")
        assert result["differs_before"] and result["loaded_equal"] and result["resumed_equal"]
        assert result["global_steps"] == 3
        without, other, engine_without = result["refusals"]
        assert "without tensor_parallel_slices" in engine_without, engine_without
        assert "loads only at model-parallel size 2" in engine_without, engine_without
        assert "saved with model parallelism" in without and "size 1" in without
        assert "model-parallel size 2" in other and "size 4" in other


def test_zero3_with_model_parallelism_is_refused_by_name(pool4):
    for message in pool4.run(jobs.zero3_refused, SEED, timeout=120.0):
        assert "stage 3" in message and "model-parallel size 2" in message


@pytest.mark.parametrize("stage", [0, 2])
def test_model_parallel_size_one_equals_no_mpu(pool2, stage):
    assert all(pool2.run(jobs.mp1_equals_no_mpu, stage, SEED, timeout=300.0))


def test_a_nonfinite_gradient_on_one_model_parallel_rank_skips_the_step_everywhere(pool4):
    for result in pool4.run(jobs.nonfinite_on_one_rank_skipped_everywhere, 2, SEED, timeout=300.0):
        assert result == {"skipped_steps": 1, "unchanged_by_skip": True, "trains_after": True}


def test_an_mpu_missing_methods_is_named(pool2):
    for message in pool2.run(jobs.bad_mpu_named, timeout=120.0):
        assert "HalfMpu lacks get_data_parallel_rank" in message
        assert "get_model_parallel_world_size" in message


# bf16 / fp16 against the fp32 reference: the tolerance is the precision's (the model, its
# inputs and its gradients are rounded; measured norms within 2.3e-3 (bf16) and 4e-4 (fp16)
# relative), below what a norm taken over the wrong ranks would change.
PRECISIONS = {
    "bf16": ({"bf16": {"enabled": True}}, 1e-2),
    "fp16": ({"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}}, 2e-3),
}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_with_model_parallelism(pool4, precision):
    extra, tolerance = PRECISIONS[precision]
    trained = pool4.run(jobs.train_matches_reference, 2, 2, SEED, jobs.CLIP, extra, timeout=300.0)
    for rank, result in enumerate(trained):
        where = (rank, precision, result["param_difference"], result["norms"])
        for ours, reference in zip(result["norms"], result["reference_norms"]):
            assert ours == pytest.approx(reference, rel=tolerance), where
            assert reference > jobs.CLIP, where
        assert result["param_difference"] <= tolerance, where  # measured: 1.7e-3, 2.1e-4
    # An overflow (inf) in one model-parallel rank's gradient: every rank skips the step, and
    # with fp16 every rank halves the same loss scale.
    skipped = pool4.run(
        jobs.nonfinite_on_one_rank_skipped_everywhere, 1, SEED, jobs.CLIP, extra, float("inf"),
        timeout=300.0,
    )  # fmt: skip
    for result in skipped:
        assert result["skipped_steps"] == 1 and result["unchanged_by_skip"], result
        assert result["trains_after"], result
        if precision == "fp16":
            assert result["loss_scales"] == (256.0, 128.0), result


@pytest.mark.parametrize("step_during_backward", [False, True])
def test_offloaded_optimizer_with_model_parallelism(pool4, step_during_backward):
    """ZeRO-2 with the optimizer on the host (CPU Adam) under an mpu equals the fp32 one-process
    reference; stepping sub-groups during backward (which excludes clipping) too, and a NaN on
    one model-parallel rank after some sub-groups were stepped is undone on every rank."""
    offload = {"device": "cpu", "step_during_backward": step_during_backward}
    # Small sub-groups: the first ones are final, and stepped, before backward ends.
    zero = {"offload_optimizer": offload, "sub_group_size": 8, "reduce_bucket_size": 8}
    extra = {"zero_optimization": zero}
    clip = 0.0 if step_during_backward else jobs.CLIP
    trained = pool4.run(jobs.train_matches_reference, 2, 2, SEED, clip, extra, timeout=300.0)
    for rank, result in enumerate(trained):
        assert result["param_difference"] <= 1e-6, (rank, result["param_difference"])
        for ours, reference in zip(result["norms"], result["reference_norms"]):
            assert ours == pytest.approx(reference, rel=1e-6), rank
    if step_during_backward:
        for result in pool4.run(
            jobs.nonfinite_on_one_rank_skipped_everywhere, 2, SEED, clip, extra, timeout=300.0
        ):
            stepped_early = result.pop("stepped_early")
            assert result == {"skipped_steps": 1, "unchanged_by_skip": True, "trains_after": True}
            assert len(stepped_early) == 1 and stepped_early[0] > 0, stepped_early
