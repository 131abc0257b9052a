"""A checkpoint of a Mixture-of-Experts model written by real DeepSpeed 0.19.8 loads into
deepspeed_cpp and continues training as DeepSpeed's own resume did.

The fixture (``fixtures/deepspeed_checkpoints/zero2_moe``, written by ``make_fixtures.py``): 2
ranks, ZeRO 2, one MoE layer of 2 experts with expert parallelism 2 (each rank holds one
expert; the experts' param group is partitioned over expert-data-parallel groups of one rank),
DeepSpeed's per-expert files ``layer_0_expert_<E>_mp_rank_00_model_states.pt``. Our engine,
built from other initial weights with our ``MoE`` layer, loads it at ZeRO 1 and 2 and trains 2
more steps: each rank's losses, learning rates and weights (its own expert included) must be
DeepSpeed's within 1e-6.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from deepspeed_fixture_model import (
    CLIENT_STATE,
    MOE_FIXTURE,
    OTHER_SEED,
    STEPS_AFTER,
    STEPS_BEFORE,
    ds_config,
    make_moe_model,
    train,
)

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "deepspeed_checkpoints" / MOE_FIXTURE[0]
TOLERANCE = 1e-6


def moe_resume_job(directories: list[str], stages: tuple[int, ...]) -> dict:
    import deepspeed_cpp as deepspeed
    from deepspeed_cpp.moe.layer import MoE

    results = {}
    for directory, stage in itertools.product(directories, stages):
        model = make_moe_model(MoE, OTHER_SEED)  # other initial weights: the load must win
        config = ds_config(dist.get_world_size(), stage, MOE_FIXTURE[2])
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        path, client_state = engine.load_checkpoint(directory)
        loaded_steps = engine.global_steps
        losses, lrs = train(engine, STEPS_BEFORE, STEPS_AFTER)
        weights = {n: t.detach().float().flatten() for n, t in engine.module.state_dict().items()}
        results[directory, stage] = {
            "path": path, "client_state": client_state, "loaded_steps": loaded_steps,
            "losses": losses, "lrs": lrs, "global_steps": engine.global_steps, "weights": weights,
        }  # fmt: skip
    return results


def test_deepspeed_moe_checkpoint_resumes_as_deepspeed_does(pool2, tmp_path):
    """The DeepSpeed folder itself, and the same converted once by ``python -m
    deepspeed_cpp.checkpoint.convert`` (experts kept in its module file under global names)."""
    from deepspeed_cpp.checkpoint.convert import main

    want = json.loads((FIXTURE / "expected.json").read_text())
    assert want["world_size"] == 2 and want["stage"] == MOE_FIXTURE[1]
    converted = tmp_path / "converted"
    assert main([str(FIXTURE), str(converted)]) == 0
    folders = [str(FIXTURE), str(converted)]
    results = pool2.run(moe_resume_job, folders, (1, 2))
    for rank, per_case in enumerate(results):
        for (folder, stage), got in per_case.items():
            case = (rank, folder, stage)
            assert got["path"] == str(Path(folder) / want["tag"]), case
            assert got["client_state"] == CLIENT_STATE, case
            assert got["loaded_steps"] == STEPS_BEFORE, case
            assert got["lrs"] == pytest.approx(want["lrs_after_resume"], rel=1e-12), case
            assert got["global_steps"] == want["global_steps_after_resume"], case
            expected_losses = want["losses_after_resume"][rank]
            assert got["losses"] == pytest.approx(expected_losses, rel=TOLERANCE, abs=TOLERANCE)
            # Each rank's state dict, its own expert under its local name, as DeepSpeed's rank.
            reference = want["weights_after_resume_per_rank"][rank]
            assert set(got["weights"]) == set(reference), case
            for name, values in reference.items():
                values = torch.tensor(values)
                worst = (got["weights"][name] - values).abs().max() / values.abs().max()
                assert worst <= TOLERANCE, (case, name, worst.item())
    # The two ranks hold different experts (the fixture would not test expert files otherwise).
    expert = "moe.deepspeed_moe.experts.deepspeed_experts.0.weight"
    key = (str(FIXTURE), 2)
    assert not torch.equal(results[0][key]["weights"][expert], results[1][key]["weights"][expert])


def test_missing_or_mismatched_experts_are_refused_by_name(tmp_path):
    """A missing expert file is named; a model with other MoE layers than the checkpoint's is
    refused with both counts; an expert group split over a rank count that does not divide the
    world is named."""
    import shutil

    from deepspeed_cpp.moe.expert_names import ExpertLayer
    from deepspeed_cpp.runtime.checkpoint.deepspeed_format import read_deepspeed_checkpoint
    from deepspeed_cpp.runtime.checkpoint.deepspeed_format.expert_groups import (
        partition_holders,
    )
    from deepspeed_cpp.runtime.checkpoint.errors import (
        CheckpointMismatchError,
        IncompleteCheckpointError,
    )
    from deepspeed_cpp.runtime.checkpoint.expert_files import check_deepspeed_experts_match

    copy = tmp_path / "moe"
    shutil.copytree(FIXTURE, copy)
    missing = "layer_0_expert_1_mp_rank_00_model_states.pt"
    (copy / "global_step2" / missing).unlink()
    named = f"{missing} is missing.*num_experts=\\[2\\]"
    with pytest.raises(IncompleteCheckpointError, match=named):
        read_deepspeed_checkpoint(copy / "global_step2", False, True)

    four = [ExpertLayer(0, "moe", 4, 2, 0, "ep_size_2")]
    with pytest.raises(CheckpointMismatchError, match="num_experts=\\[2\\], the model \\[4\\]"):
        check_deepspeed_experts_match([2], four, copy)
    with pytest.raises(CheckpointMismatchError, match="num_experts=\\[\\], the model \\[4\\]"):
        check_deepspeed_experts_match(None, four, copy)
    with pytest.raises(CheckpointMismatchError, match="3 partitions.*4 ranks"):
        partition_holders(4, 3, "somewhere")
    assert partition_holders(4, 2, "x") == [[0, 2], [1, 3]]  # ep 2: rank r is ep rank r % 2
