"""``initialize(mpu=...)`` at ZeRO 0, 1 and 2 on real gloo pools: 4 ranks as 2 model-parallel x
2 data-parallel, each model-parallel index training another part of one model, against the whole
model trained in one process (``model_parallel_jobs.py``); checkpoints per model-parallel rank;
and model-parallel size 1 on 2 ranks equal to no mpu at all."""

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
        without, other = result["refusals"]
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
