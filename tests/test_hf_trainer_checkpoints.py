"""deepspeed_cpp.hf.Trainer's checkpoints on 2 CPU ranks (gloo): what a checkpoint folder holds
(transformers' files beside the engine's, ``zero_to_fp32.py`` runnable there), ZeRO-3
``save_model`` of a tied model, evaluation with the best model reloaded, bitwise-exact resume
across an epoch boundary, and a clear error for a folder without the engine's checkpoint
(training itself against transformers' own Trainer: test_hf_trainer.py)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from conftest import REPO_ROOT  # noqa: E402
from hf_trainer_jobs import MICRO, WORLD, auto_config, run_trainer, tiny_gpt2  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


def test_checkpoints_hold_transformers_files_and_the_engines(pool2, tmp_path):
    results = pool2.run(
        run_trainer,
        {
            "output_dir": str(tmp_path),
            "deepspeed": auto_config(3),
            "max_steps": 4,
            "save_steps": 2,
        },
    )
    for step in (2, 4):
        folder = tmp_path / f"checkpoint-{step}"
        names = set(os.listdir(folder))
        for expected in ("model.safetensors", "trainer_state.json", "training_args.bin"):
            assert expected in names, f"{expected} missing from {folder}: {sorted(names)}"
        assert "config.json" in names
        assert (folder / "latest").read_text().strip() == f"global_step{step}"
        assert (folder / f"global_step{step}").is_dir()
        assert "optimizer.pt" not in names, "the optimizer lives in the engine's checkpoint"
        assert ".deepspeed_cpp_save.lock" not in names, "the save lock leaves no file behind"
        assert "zero_to_fp32.py" in names, "the guide's recovery script, beside latest"
    # The safetensors file holds the whole model (gathered: ZeRO-3 trained it in shards), the
    # final weights at the last checkpoint; the tied lm_head is stored once, as transformers does.
    saved = load_file(str(tmp_path / "checkpoint-4" / "model.safetensors"))
    final = results[0]["weights"]
    assert set(saved) == set(final) - {"lm_head.weight"}
    for name, value in saved.items():
        assert torch.equal(value, final[name]), name
    # The engine's part of checkpoint-N is an ordinary ZeRO checkpoint: zero_to_fp32 reads it.
    from deepspeed_cpp.utils.zero_to_fp32 import load_state_dict_from_zero_checkpoint

    model = load_state_dict_from_zero_checkpoint(tiny_gpt2(), tmp_path / "checkpoint-4")
    for name, value in model.state_dict().items():
        assert torch.equal(value, final[name]), name
    # The guide's command, run where it says: `cd checkpoint-N; python zero_to_fp32.py . OUT`.
    done = subprocess.run(
        [sys.executable, "zero_to_fp32.py", ".", "fp32"], cwd=tmp_path / "checkpoint-4",
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    recovered = torch.load(tmp_path / "checkpoint-4" / "fp32" / "pytorch_model.bin")
    assert set(recovered) == set(final)
    for name, value in recovered.items():
        assert torch.equal(value, final[name]), name


def test_zero3_save_model_stores_the_tied_output_layer_once_as_transformers_does(pool2, tmp_path):
    """``save_model`` at ZeRO-3 with ``stage3_gather_16bit_weights_on_model_save``, the
    embedding partitioned (threshold 100): ``model.safetensors`` holds the names transformers'
    own ``save_pretrained`` writes for a tied GPT-2 (no ``lm_head.weight``), as with DeepSpeed,
    and ``from_pretrained`` of it gives the trained model, tied. The gathered state dict had a
    copy of the tied tensor per name, which transformers cannot tell from two weights."""
    from transformers import GPT2LMHeadModel

    config = auto_config(3)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 100
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    spec = {"output_dir": str(tmp_path / "ours"), "micro": MICRO, "deepspeed": config,
            "max_steps": 2, "save_model": True}  # fmt: skip
    final = pool2.run(run_trainer, spec)[0]["weights"]
    tiny_gpt2().save_pretrained(tmp_path / "transformers")
    theirs = load_file(str(tmp_path / "transformers" / "model.safetensors"))
    saved = load_file(str(tmp_path / "ours" / "model.safetensors"))
    assert "lm_head.weight" not in saved
    assert set(saved) == set(theirs)
    reloaded = GPT2LMHeadModel.from_pretrained(tmp_path / "ours")
    assert reloaded.lm_head.weight is reloaded.transformer.wte.weight
    state = reloaded.state_dict()
    assert set(state) == set(final)
    for name, value in state.items():
        assert torch.equal(value, final[name]), name


def test_zero3_evaluation_and_best_model_at_end_match_the_reference(pool2, tmp_path):
    spec = {"max_steps": 6, "save_steps": 2, "evaluate": True, "micro": MICRO}
    ours = pool2.run(
        run_trainer, dict(spec, output_dir=str(tmp_path / "ours"), deepspeed=auto_config(3))
    )[0]
    theirs = run_trainer(
        dict(spec, output_dir=str(tmp_path / "theirs"), deepspeed=None, micro=MICRO * WORLD)
    )
    assert len(ours["eval_losses"]) == 3
    assert ours["eval_losses"] == pytest.approx(theirs["eval_losses"], abs=1e-5)
    assert os.path.basename(ours["best_checkpoint"]) == os.path.basename(theirs["best_checkpoint"])
    assert not ours["best_checkpoint"].endswith("checkpoint-6"), "an earlier one is reloaded"
    # After training the best checkpoint's weights are back in the (ZeRO-3 partitioned) model.
    assert ours["final_eval_loss"] == pytest.approx(max(ours["eval_losses"]), abs=1e-6)
    assert ours["final_eval_loss"] == pytest.approx(theirs["final_eval_loss"], abs=1e-5)


def _trainer_state_file(checkpoint) -> dict:
    """global_step, epoch and the per-step log of a checkpoint's trainer_state.json."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    steps = [entry for entry in state["log_history"] if "loss" in entry]
    return {"global_step": state["global_step"], "epoch": state["epoch"], "log": steps}


def test_resume_from_step_5_and_past_an_epoch_boundary_is_bitwise_exact(pool2, tmp_path):
    # 64 samples / 8 a step: an epoch is 8 steps. Resuming at step 5 crosses the epoch boundary
    # while training again; step 9 is in the second epoch (the data order is the resumed sampler's).
    common = {"deepspeed": auto_config(2), "max_steps": 10, "save_at": [10]}
    straight = pool2.run(
        run_trainer, dict(common, output_dir=str(tmp_path / "a"), save_at=[5, 9, 10])
    )
    # resume_from_checkpoint=True finds the last checkpoint in output_dir: give it step 5 only.
    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a" / "checkpoint-5", tmp_path / "b" / "checkpoint-5")
    from_5 = pool2.run(run_trainer, dict(common, output_dir=str(tmp_path / "b"), resume=True))
    from_9 = pool2.run(
        run_trainer,
        dict(common, output_dir=str(tmp_path / "c"), resume=str(tmp_path / "a" / "checkpoint-9")),
    )
    expected = _trainer_state_file(tmp_path / "a" / "checkpoint-10")
    assert expected["global_step"] == 10 and expected["epoch"] == pytest.approx(1.25)
    assert [entry["step"] for entry in expected["log"]] == list(range(1, 11))
    for name, resumed in (("step 5", from_5), ("step 9", from_9)):
        # The Trainer's state as trained (steps 1..k come back from trainer_state.json, the rest
        # are trained again), then as written in the final checkpoint: whole log entries.
        assert resumed[0]["global_step"] == straight[0]["global_step"] == 10, name
        assert resumed[0]["epoch"] == straight[0]["epoch"], name
        assert resumed[0]["log_history"] == straight[0]["log_history"], name
        folder = "b" if resumed is from_5 else "c"
        assert _trainer_state_file(tmp_path / folder / "checkpoint-10") == expected, name
        for key, value in straight[0]["weights"].items():
            assert torch.equal(resumed[0]["weights"][key], value), f"{name}: {key}"


def test_resume_from_a_folder_without_engine_checkpoint_fails_clearly(pool2, tmp_path):
    (tmp_path / "checkpoint-3").mkdir()
    with pytest.raises(RuntimeError, match="Can't find a valid checkpoint.*'latest'"):
        pool2.run(
            run_trainer,
            {
                "output_dir": str(tmp_path),
                "deepspeed": auto_config(1),
                "resume": str(tmp_path / "checkpoint-3"),
            },
        )
