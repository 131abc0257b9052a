"""The Hugging Face guide's "auto" rules and mismatch error (deepspeed_cpp.hf), no processes."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from deepspeed_cpp.integrations.hf.config_filling import (  # noqa: E402
    ConfigMismatchError,
    fill_from_arguments,
    fill_from_model_and_steps,
    model_hidden_size,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


def _arguments(**overrides):
    """The TrainingArguments fields the rules read, with transformers' defaults."""
    values = dict(
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_grad_norm=1.0,
        learning_rate=5e-5,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        fp16=False,
        fp16_full_eval=False,
        bf16=False,
        bf16_full_eval=False,
    )
    values.update(overrides)
    return SimpleNamespace(**values)


def _all_auto_config():
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
        "fp16": {"enabled": "auto"},
        "bf16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        },
    }


def test_arguments_fill_every_auto_key_with_the_guides_rules():
    args = _arguments(learning_rate=3e-4, adam_beta2=0.95, weight_decay=0.1, bf16=True)
    config = _all_auto_config()
    filled = fill_from_arguments(config, args, world_size=3)
    assert filled["train_micro_batch_size_per_gpu"] == 4
    assert filled["gradient_accumulation_steps"] == 2
    assert filled["train_batch_size"] == 4 * 2 * 3
    assert filled["gradient_clipping"] == 1.0
    assert filled["optimizer"]["params"] == {
        "lr": 3e-4,
        "betas": [0.9, 0.95],
        "eps": 1e-8,
        "weight_decay": 0.1,
    }
    scheduler = filled["scheduler"]["params"]
    assert scheduler["warmup_min_lr"] == 0 and scheduler["warmup_max_lr"] == 3e-4
    # The step counts wait for the Trainer.
    assert scheduler["warmup_num_steps"] == "auto" and scheduler["total_num_steps"] == "auto"
    assert filled["fp16"]["enabled"] is False and filled["bf16"]["enabled"] is True
    assert config["train_batch_size"] == "auto", "the caller's dict is left as it was"


def test_full_eval_flags_count_as_precision_requests():
    filled = fill_from_arguments({"fp16": {"enabled": "auto"}}, _arguments(fp16_full_eval=True), 1)
    assert filled["fp16"]["enabled"] is True


def test_batch_keys_left_out_take_the_trainers_numbers():
    filled = fill_from_arguments({"zero_optimization": {"stage": 2}}, _arguments(), world_size=2)
    assert filled["train_micro_batch_size_per_gpu"] == 4
    assert filled["gradient_accumulation_steps"] == 2
    assert filled["train_batch_size"] == 16
    assert "gradient_clipping" not in filled, "other keys left out stay out"


def test_values_that_agree_are_accepted():
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "train_batch_size": 16,
        "gradient_clipping": 1,  # 1 == 1.0
        "optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.999], "lr": 5e-5}},
    }
    assert fill_from_arguments(config, _arguments(), world_size=2) == config


def test_one_error_names_every_conflicting_key():
    config = _all_auto_config()
    config["train_micro_batch_size_per_gpu"] = 8
    config["train_batch_size"] = 8
    config["gradient_clipping"] = 0.5
    config["optimizer"]["params"]["lr"] = 1e-3
    config["optimizer"]["params"]["betas"] = [0.9, 0.98]
    config["fp16"]["enabled"] = True
    with pytest.raises(ConfigMismatchError) as caught:
        fill_from_arguments(config, _arguments(), world_size=2)
    message = str(caught.value)
    for key, argument in [
        ("'train_micro_batch_size_per_gpu' = 8", "per_device_train_batch_size = 4"),
        ("'train_batch_size' = 8", "(2 x 4 x 2) = 16"),
        ("'gradient_clipping' = 0.5", "max_grad_norm = 1.0"),
        ("'optimizer.params.lr' = 0.001", "learning_rate = 5e-05"),
        ("'optimizer.params.betas' = [0.9, 0.98]", "[adam_beta1, adam_beta2] = [0.9, 0.999]"),
        ("'fp16.enabled' = True", "fp16 or fp16_full_eval = False"),
    ]:
        assert key in message and argument in message, message
    assert len(caught.value.mismatches) == 6
    assert '"auto"' in message


def test_warmup_floor_is_no_argument_and_never_a_mismatch():
    config = {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-6}}}
    assert fill_from_arguments(config, _arguments(), 1)["scheduler"] == config["scheduler"]


def _model(**config):
    return SimpleNamespace(config=SimpleNamespace(**config))


def test_model_and_steps_fill_bucket_sizes_and_step_counts():
    config = fill_from_arguments(_all_auto_config(), _arguments(), world_size=1)
    filled = fill_from_model_and_steps(
        config, _model(hidden_size=64), num_training_steps=100, warmup_steps=10
    )
    zero = filled["zero_optimization"]
    assert zero["reduce_bucket_size"] == 64 * 64
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)
    assert zero["stage3_param_persistence_threshold"] == 10 * 64
    assert filled["scheduler"]["params"]["total_num_steps"] == 100
    assert filled["scheduler"]["params"]["warmup_num_steps"] == 10


def test_no_warmup_still_gives_one_warmup_step():
    config = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}
    filled = fill_from_model_and_steps(config, _model(), num_training_steps=5, warmup_steps=0)
    assert filled["scheduler"]["params"]["warmup_num_steps"] == 1


def test_step_counts_that_disagree_are_named_together():
    config = {
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_num_steps": 7, "total_num_steps": 50},
        }
    }
    with pytest.raises(ConfigMismatchError) as caught:
        fill_from_model_and_steps(config, _model(), num_training_steps=100, warmup_steps=10)
    message = str(caught.value)
    assert "'scheduler.params.total_num_steps' = 50" in message and "= 100" in message
    assert "'scheduler.params.warmup_num_steps' = 7" in message and "= 10" in message


def test_hidden_size_sources():
    assert model_hidden_size(_model(hidden_size=48)) == 48
    assert model_hidden_size(_model(hidden_sizes=[16, 96, 32])) == 96
    assert model_hidden_size(_model(text_config=SimpleNamespace(hidden_size=24))) == 24
    assert model_hidden_size(_model()) is None


def test_hidden_size_auto_without_a_hidden_size_names_the_keys():
    config = {"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}
    with pytest.raises(ValueError, match="'zero_optimization.reduce_bucket_size'.*hidden size"):
        fill_from_model_and_steps(config, _model(), num_training_steps=1, warmup_steps=0)


# --- the arguments classes ---------------------------------------------------------------------
def test_training_arguments_take_deepspeed_without_the_deepspeed_distribution(tmp_path):
    from deepspeed_cpp.hf import TrainingArguments

    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto"}
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=3, max_grad_norm=0.5, deepspeed=config
    )
    assert args.deepspeed == config, "the user's value reads back unchanged"
    assert args.deepspeed_cpp_enabled
    assert args.deepspeed_cpp_config["train_micro_batch_size_per_gpu"] == 3
    assert args.deepspeed_cpp_config["train_batch_size"] == 3
    assert args.deepspeed_cpp_config["gradient_clipping"] == 0.5
    assert args.deepspeed_plugin is None, "accelerate's DeepSpeed plugin is not involved"
    assert "deepspeed" not in sys.modules


def test_deepspeed_flag_through_hf_argument_parser(tmp_path):
    from transformers import HfArgumentParser

    from deepspeed_cpp.hf import TrainingArguments

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"gradient_accumulation_steps": "auto"}))
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        [
            "--output_dir",
            str(tmp_path),
            "--deepspeed",
            str(path),
            "--gradient_accumulation_steps",
            "4",
        ]
    )
    assert args.deepspeed == str(path)
    assert args.deepspeed_cpp_config["gradient_accumulation_steps"] == 4


def test_arguments_mismatch_fails_when_the_arguments_are_built(tmp_path):
    from deepspeed_cpp.hf import TrainingArguments

    with pytest.raises(ConfigMismatchError, match="'gradient_accumulation_steps' = 2"):
        TrainingArguments(output_dir=str(tmp_path), deepspeed={"gradient_accumulation_steps": 2})


def test_an_invalid_config_fails_when_the_arguments_are_built(tmp_path):
    from deepspeed_cpp.hf import TrainingArguments

    with pytest.raises(ValueError, match="zero_optimization"):
        TrainingArguments(output_dir=str(tmp_path), deepspeed={"zero_optimization": {"stage": 7}})


def test_seq2seq_arguments_take_deepspeed_too(tmp_path):
    from deepspeed_cpp.hf import Seq2SeqTrainingArguments

    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path), predict_with_generate=True, deepspeed={"train_batch_size": "auto"}
    )
    assert args.deepspeed_cpp_config["train_batch_size"] == 8


def test_config_filled_again_for_a_trials_values_and_a_found_batch(tmp_path):
    from deepspeed_cpp.hf import TrainingArguments

    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
    }
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        gradient_accumulation_steps=3,
        learning_rate=1e-3,
        deepspeed=config,
    )
    # A hyper-parameter trial sets its values on the arguments.
    args.learning_rate = 4e-4
    refilled = args.refill_deepspeed_cpp_config()
    assert refilled["optimizer"]["params"]["lr"] == 4e-4
    assert args.deepspeed_cpp_config["optimizer"]["params"]["lr"] == 1e-3, "a new dict"
    # auto_find_batch_size's batch: the arguments keep the user's.
    found = args.refill_deepspeed_cpp_config(per_device_train_batch_size=5)
    assert found["train_micro_batch_size_per_gpu"] == 5
    assert found["train_batch_size"] == 5 * 3
    assert args.per_device_train_batch_size == 8


def test_a_found_batch_with_fixed_batch_keys_names_them(tmp_path):
    from deepspeed_cpp.hf import TrainingArguments

    config = {"train_micro_batch_size_per_gpu": 8, "train_batch_size": 8}
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, deepspeed=config
    )
    same = args.refill_deepspeed_cpp_config(per_device_train_batch_size=8)
    assert same["train_micro_batch_size_per_gpu"] == same["train_batch_size"] == 8
    with pytest.raises(ValueError) as caught:
        args.refill_deepspeed_cpp_config(per_device_train_batch_size=7)
    message = str(caught.value)
    assert "lowered the per-device batch to 7" in message
    assert "'train_micro_batch_size_per_gpu' = 8" in message and "'train_batch_size' = 8" in message
    assert 'expected "auto"' in message


def test_without_deepspeed_the_arguments_are_transformers_own(tmp_path):
    from deepspeed_cpp.hf import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path))
    assert not args.deepspeed_cpp_enabled and args.deepspeed is None


# --- transformers stays optional -------------------------------------------------------------
def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_transformers_stays_optional():
    # One fresh interpreter for both checks (a start costs seconds): importing deepspeed_cpp
    # imports neither transformers nor accelerate; then, with transformers made unimportable
    # (sys.modules[name] = None makes `import name` raise ImportError), deepspeed_cpp.hf says
    # what to install.
    done = _python(
        "import sys, deepspeed_cpp\n"
        "print(sorted(m for m in ('transformers', 'accelerate') if m in sys.modules))\n"
        "sys.modules['transformers'] = None\n"
        "import deepspeed_cpp.hf\n"
    )
    assert done.returncode != 0
    assert done.stdout.strip() == "[]", done.stderr
    assert "ImportError" in done.stderr and "pip install deepspeed_cpp[hf]" in done.stderr
    assert "transformers" in done.stderr.splitlines()[-1]


# --- HfDeepSpeedConfig: is ZeRO-3 on, for code outside the Trainer ----------------------------
def test_hf_deepspeed_config_answers_while_alive():
    import gc

    import transformers.integrations.deepspeed as transformers_deepspeed

    from deepspeed_cpp import hf

    keeper = hf.HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_batch_size": "auto"})
    assert hf.is_deepspeed_zero3_enabled() and keeper.is_zero3() and not keeper.is_offload()
    assert hf.deepspeed_config()["zero_optimization"] == {"stage": 3}
    # transformers' own check answers for the deepspeed distribution: it stays off.
    assert not transformers_deepspeed.is_deepspeed_zero3_enabled()
    del keeper
    gc.collect()
    assert not hf.is_deepspeed_zero3_enabled() and hf.deepspeed_config() is None
    below_three = hf.HfDeepSpeedConfig(
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    )
    assert not hf.is_deepspeed_zero3_enabled() and below_three.is_offload()


def test_training_arguments_keep_their_config_alive(tmp_path):
    from deepspeed_cpp import hf

    args = hf.TrainingArguments(
        output_dir=str(tmp_path), deepspeed={"zero_optimization": {"stage": 3}}
    )
    assert hf.is_deepspeed_zero3_enabled()
    assert hf.deepspeed_config() == args.deepspeed_cpp_config


# --- the supported range ---------------------------------------------------------------------
def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("+")[0].split(".")[:3])


def test_supported_range_is_declared_alike_and_its_lowest_end_is_the_tested_one():
    import tomllib

    from deepspeed_cpp.integrations.hf import SUPPORTED

    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    declared = [
        entry
        for entry in extras["optional-dependencies"]["hf"]
        if entry.startswith(("transformers", "accelerate"))
    ]
    assert sorted(declared) == sorted(
        f"{name}>={lowest},<{below}" for name, (lowest, below) in SUPPORTED.items()
    )
    pins = {}
    for line in (REPO_ROOT / "scripts" / "hf_lowest.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name] = version
    for name, (lowest, _) in SUPPORTED.items():
        assert pins[name] == lowest, f"scripts/hf_lowest.txt pins {name} {pins[name]}"


def test_the_imported_versions_are_in_the_range_and_the_ones_asked_for():
    # scripts/test.sh runs this module again with the lowest versions first on PYTHONPATH and
    # names them in DS_CPP_HF_EXPECT_VERSIONS: that run must really import them.
    import accelerate
    import transformers

    from deepspeed_cpp.integrations.hf import SUPPORTED

    imported = {"transformers": transformers.__version__, "accelerate": accelerate.__version__}
    for name, (lowest, below) in SUPPORTED.items():
        assert _version(lowest) <= _version(imported[name]) < _version(below), (name, imported)
    for pin in os.environ.get("DS_CPP_HF_EXPECT_VERSIONS", "").split():
        name, version = pin.split("==")
        assert imported[name] == version, f"{name} {imported[name]} imported, {version} expected"
