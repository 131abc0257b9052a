"""A checkpoint of real DeepSpeed's AutoTP training (0.19.8, ``tensor_parallel.autotp_size`` 2,
ZeRO 1, fp32: the committed fixture ``autotp2_zero1``, written by ``make_fixtures.py``) loads into
deepspeed_cpp: at TP 2 (each rank its own ``mp_rank_XX`` part; ZeRO 1 and 2) and joined at TP 1
(2 data-parallel ranks; ZeRO 2 and 3), directly and after ``python -m
deepspeed_cpp.checkpoint.convert``. Two more steps
must give DeepSpeed's own resume (``expected.json``: losses, lrs, unsplit weights) within 1e-6.
Bad input is refused by name: a part's file missing, another TP size, a split that differs from
deepspeed_cpp's policy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from deepspeed_fixture_model import (
    CLIENT_STATE,
    OTHER_SEED,
    STEPS_AFTER,
    STEPS_BEFORE,
    TP_FIXTURE,
    TP_SIZE,
    make_tp_model,
    tp_config,
    tp_train,
)

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "deepspeed_checkpoints" / TP_FIXTURE[0]
TOLERANCE = 1e-6


def expected() -> dict:
    return json.loads((FIXTURE / "expected.json").read_text())


def resume_at(tp: int, stage: int, directory: str) -> dict:
    """An engine at TP ``tp`` (ZeRO ``stage``, the rest of the 2 ranks data parallel) built from
    other weights loads ``directory`` and trains 2 steps."""
    import deepspeed_cpp as deepspeed

    dp = dist.get_world_size() // tp
    config = tp_config(tp, dp)
    config["zero_optimization"]["stage"] = stage
    engine, *_ = deepspeed.initialize(model=make_tp_model(OTHER_SEED), config=config)
    path, client_state = engine.load_checkpoint(directory)
    loaded = (path, client_state, engine.global_steps)
    dp_rank = dist.get_rank() % dp if tp == 1 else 0
    losses, lrs = tp_train(engine, STEPS_BEFORE, STEPS_AFTER, dp_rank, dp)
    if dp > 1:  # every rank's mean over its rows; the global batch's loss is their mean
        losses = [loss / dp for loss in losses]
        total = torch.tensor(losses, dtype=torch.float64)
        dist.all_reduce(total)
        losses = total.tolist()
    weights = {n: t.detach().float().clone() for n, t in engine.whole_model_state_dict().items()}
    steps = engine.global_steps
    engine.destroy()
    return {"loaded": loaded, "losses": losses, "lrs": lrs, "steps": steps, "weights": weights}


def resume_job(directories: list[str]) -> list[dict]:
    """Every (directory, TP, ZeRO stage) case in one launch."""
    cases = [(2, 1), (1, 2), (2, 2), (1, 3)]
    return [resume_at(tp, stage, d) for d in directories for tp, stage in cases]


def _check(result: dict, want: dict, path: str) -> None:
    assert result["loaded"] == (path, CLIENT_STATE, STEPS_BEFORE)
    assert result["lrs"] == pytest.approx(want["lrs_after_resume"], rel=1e-12)
    assert result["steps"] == want["global_steps_after_resume"]
    assert result["losses"] == pytest.approx(
        want["losses_after_resume"][0], rel=TOLERANCE, abs=TOLERANCE
    )
    weights = result["weights"]
    assert sorted(weights) == sorted(want["weights_after_resume"])
    for name, values in want["weights_after_resume"].items():
        reference = torch.tensor(values).view(weights[name].shape)
        assert (weights[name] - reference).abs().max().item() <= TOLERANCE, name


def test_deepspeed_autotp_checkpoint_resumes_at_tp2_and_tp1_direct_and_converted(pools, tmp_path):
    from deepspeed_cpp.checkpoint.convert import main

    want = expected()
    assert want["tensor_parallel_size"] == TP_SIZE and want["world_size"] == 2
    converted = tmp_path / "converted"
    assert main([str(FIXTURE), str(converted)]) == 0
    meta = json.loads((converted / want["tag"] / "checkpoint_meta.json").read_text())
    # Written joined; DeepSpeed's split kept for the check at TP 2 (tensor_parallel_reshard.py).
    recorded = meta["converted_from"]
    assert recorded["tensor_parallel_size"] == TP_SIZE
    assert recorded["tensor_parallel_splits"]["model.layers.0.mlp.down_proj.weight"] == 1
    assert len(recorded["tensor_parallel_splits"]) == 8  # q k v o gate up down, lm_head
    results = pools(2).run(resume_job, [str(FIXTURE), str(converted)])
    tag = want["tag"]
    for rank_results in results:  # TP 2 at ZeRO 1 and 2, TP 1 (DP 2) at ZeRO 2 and 3
        direct, from_converted = rank_results[:4], rank_results[4:]
        for result in direct:
            _check(result, want, str(FIXTURE / tag))
        for result in from_converted:  # converted: ours at TP 1, re-cut
            _check(result, want, str(converted / tag))


# ---- refused, by name (read in this process: no ranks needed) --------------------------------


def _copy_without(tmp_path: Path, missing: str) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(FIXTURE, copy)
    (copy / "global_step2" / missing).unlink()
    return copy / "global_step2"


@pytest.mark.parametrize(
    "missing", ["mp_rank_01_model_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt"]
)
def test_missing_part_is_named(tmp_path, missing):
    from deepspeed_cpp.runtime.checkpoint.deepspeed_format import read_deepspeed_checkpoint
    from deepspeed_cpp.runtime.checkpoint.errors import IncompleteCheckpointError

    directory = _copy_without(tmp_path, missing)
    with pytest.raises(IncompleteCheckpointError, match=f"incomplete: {missing} is missing"):
        read_deepspeed_checkpoint(directory, False, True)


def test_other_tp_size_and_other_split_are_refused_by_name():
    from deepspeed_cpp.module_inject import planned_slices
    from deepspeed_cpp.runtime.checkpoint.deepspeed_format import read_deepspeed_checkpoint
    from deepspeed_cpp.runtime.checkpoint.deepspeed_format.tensor_parallel import (
        SPLITS_KEY,
        fit_to_engine,
    )
    from deepspeed_cpp.runtime.checkpoint.errors import (
        CheckpointMismatchError,
        ModelParallelMismatchError,
    )

    saved = read_deepspeed_checkpoint(FIXTURE / "global_step2", False, True)
    model = make_tp_model(OTHER_SEED)
    splits = saved.info[SPLITS_KEY]
    # DeepSpeed's split of the Llama is deepspeed_cpp's policy's: q/k/v/gate/up and the
    # lm_head's vocabulary by rows, o/down by columns, embeddings and norms whole.
    assert {n: [d, 1] for n, d in splits.items()} == planned_slices(model, TP_SIZE)
    assert splits["model.layers.0.self_attn.o_proj.weight"] == 1
    assert splits["lm_head.weight"] == 0 and "model.embed_tokens.weight" not in splits
    joined = dict(saved.module_state)
    assert joined["lm_head.weight"].shape == model.lm_head.weight.shape
    with pytest.raises(ModelParallelMismatchError, match="saved by DeepSpeed at tensor-parallel "
                       "size 2; this engine runs at tensor-parallel size 4"):  # fmt: skip
        fit_to_engine(saved, model, 0, 4)
    # A DeepSpeed checkpoint without tensor parallelism is not cut for a TP engine.
    zero2 = FIXTURE.parent / "zero2" / "global_step2"
    data_parallel = read_deepspeed_checkpoint(zero2, False, True)
    with pytest.raises(ModelParallelMismatchError, match="without tensor parallelism; this engine "
                       "runs at model-parallel size 2"):  # fmt: skip
        fit_to_engine(data_parallel, model, 0, 2)
    saved.info[SPLITS_KEY] = {**splits, "model.layers.0.mlp.down_proj.weight": 0}
    refused = r"'model\.layers\.0\.mlp\.down_proj\.weight': DeepSpeed's AutoTP split it along "
    with pytest.raises(CheckpointMismatchError, match=refused + "dimension 0 .* along dimension 1"):
        fit_to_engine(saved, model, 0, 1)


def test_converted_checkpoint_keeps_the_split_check(tmp_path):
    """The converted folder (ours, TP 1) re-cut at TP 2 is held to DeepSpeed's split too: a model
    that deepspeed_cpp's policy would leave whole is refused naming a parameter."""
    from deepspeed_cpp.checkpoint.convert import main
    from deepspeed_cpp.runtime.checkpoint import tensor_parallel_reshard as tp_reshard
    from deepspeed_cpp.runtime.checkpoint.errors import CheckpointMismatchError

    converted = tmp_path / "converted"
    assert main([str(FIXTURE), str(converted)]) == 0
    parts = tp_reshard.read_parts([converted / expected()["tag"]], False)
    unsplit = make_tp_model(OTHER_SEED)  # holds no TP slices: every DeepSpeed split disagrees
    with pytest.raises(CheckpointMismatchError, match=r"'lm_head\.weight': DeepSpeed's AutoTP "
                       r"split it along dimension 0 at tensor-parallel size 2"):  # fmt: skip
        tp_reshard.Recut(parts, unsplit, 0, 2)
