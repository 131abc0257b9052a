"""transformers' own ZeRO-3 construction under the ``import deepspeed`` alias, on 2 gloo ranks.

While a stage-3 ``HfDeepSpeedConfig`` is alive, transformers' ``from_pretrained`` and
``from_config`` build the model under ``deepspeed.zero.Init`` (with its
``prevent_arange_dtype_change`` swapping ``zero_wrapper_for_fp_tensor_constructor``), then load
the weights one module at a time through ``GatheredParameters(..., modifier_rank=0)``. Both the
guide's non-Trainer pattern and a ``run_clm.py``-shaped Trainer script run here as their users run
them: unmodified, under ``python -m deepspeed_cpp.launcher --alias-deepspeed``, with the newest
transformers of the venv and the lowest supported one (scripts/hf_lowest.txt). One launch per end
runs the three scripts one after the other in the same two ranks (tests/hf_zero3_jobs.py, which
checks that no stage-3 config outlives a script); the tests read what each wrote.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import free_port, launch_env

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

REPO_ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
EXAMPLE = REPO_ROOT / "examples" / "hf_trainer"
LOWEST = Path(sys.prefix) / "hf-lowest"
WORLD = 2


@pytest.fixture(scope="module")
def saved_gpt2(tmp_path_factory) -> Path:
    """The example's tiny GPT-2 (seeded, tied embeddings) saved as transformers saves it."""
    sys.path.insert(0, str(EXAMPLE))
    from train_tiny_gpt2 import tiny_gpt2

    folder = tmp_path_factory.mktemp("tiny_gpt2")
    tiny_gpt2().save_pretrained(folder)
    return folder


def _transformers_paths(end: str) -> str:
    if end == "lowest":
        if not (LOWEST / "transformers").is_dir():
            pytest.skip(f"the lowest supported transformers is not installed at {LOWEST}")
        return f"{LOWEST}:{REPO_ROOT}"
    return str(REPO_ROOT)


def _transformers_version(end: str) -> str:
    """The transformers version the ranks must import at ``end`` of the supported range."""
    if end == "lowest":
        pins = (REPO_ROOT / "scripts" / "hf_lowest.txt").read_text().splitlines()
        return next(line.split("==")[1] for line in pins if line.startswith("transformers=="))
    import transformers

    return transformers.__version__


def _launch(script: Path, args: list[str], pythonpath: str, cwd: Path, **env) -> str:
    command = [
        sys.executable, "-m", "deepspeed_cpp.launcher", "--num_gpus", str(WORLD),
        "--master_port", str(free_port()), "--alias-deepspeed", str(script), *args,
    ]  # fmt: skip
    run = subprocess.run(
        command,
        env=launch_env(PYTHONPATH=pythonpath, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=cwd,
        timeout=800,  # three scripts in one launch; pytest-timeout's 900 s bounds the test
    )
    assert run.returncode == 0, run.stdout[-8000:]
    return run.stdout


@pytest.mark.parametrize("end", ["newest", "lowest"])
def test_guide_pattern_builds_partitioned_from_pretrained_and_from_config(
    saved_gpt2, zero3_launch, end
):
    """``HfDeepSpeedConfig(ds_config)`` kept alive, then ``AutoModelForCausalLM.from_pretrained``:
    every parameter is partitioned (an empty local tensor, a shard of the padded size) and its
    gathered value is the saved tensor bit for bit; the output layer stays tied to the input
    embedding. ``from_config`` partitions as well, and rank 0's initialisation reaches both ranks.
    """
    import torch
    from safetensors.torch import load_file

    output, folder = zero3_launch(end)
    reports = folder / "reports" / "guide"
    # Nothing that reads as failure: zero.Init's wrapped __init__ looks like the class's own to
    # transformers' @auto_docstring (test_zero_init_wrapping.py has the case that printed
    # "[ERROR] `module` is part of Init._wrap..." once per model class).
    assert "[ERROR]" not in output, output[-8000:]
    ranks = [json.loads((reports / f"rank{r}.json").read_text()) for r in range(WORLD)]
    saved = load_file(str(saved_gpt2 / "model.safetensors"))
    expected = {name for name in saved if name != "lm_head.weight"}
    for report in ranks:
        assert report["world_size"] == WORLD
        assert report["deepspeed_module"] == "deepspeed_cpp"  # the alias, not a real DeepSpeed
        assert report["lm_head_tied"]
        assert set(report["from_pretrained"]) == expected
        for name, entry in report["from_pretrained"].items():
            numel = saved[name].numel()
            assert entry["zero"] and entry["status"] == "NOT_AVAILABLE", name
            assert entry["local_numel"] == 0 and entry["shape"] == list(saved[name].shape), name
            # Shards of the padded size: the whole rounded up to a multiple of 16 per rank.
            assert 0 <= entry["shard_numel"] * WORLD - numel < 16 * WORLD, name
            assert entry["equals_saved"], name
        for name, entry in report["from_config"].items():
            assert entry["zero"] and entry["status"] == "NOT_AVAILABLE", name
    # The fresh model was initialised once (rank 0) and scattered: both ranks gather the same
    # values, and those are transformers' GPT-2 initialisation (not the empty tensors it was
    # built on): LayerNorm weights one, embeddings drawn with std 0.02.
    assert ranks[0]["from_config"] == ranks[1]["from_config"]
    fresh = ranks[0]["from_config"]
    assert fresh["transformer.ln_f.weight"]["digest"] == [32.0, 32.0]
    wte_sum, wte_squares = fresh["transformer.wte.weight"]["digest"]
    assert wte_squares / (64 * 32) == pytest.approx(0.02**2, rel=0.2)
    assert not torch.isnan(torch.tensor(wte_sum))


def _trainer_config(folder: Path) -> Path:
    """The example's ds_config ("auto" everywhere the guide allows) at ZeRO-3, with every
    parameter partitioned at construction (the "auto" persistence threshold is only known once
    the Trainer has the model, so zero.Init uses DeepSpeed's default, 100k elements: more than
    any parameter of the tiny model)."""
    config = json.loads((EXAMPLE / "ds_config.json").read_text())
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    path = folder / "ds_config_zero3.json"
    path.write_text(json.dumps(config))
    return path


GLOBAL_BATCH = 8
STEPS = 4


@pytest.fixture(scope="module")
def one_process_reference(tmp_path_factory) -> list[float]:
    """transformers' own Trainer in this process, no DeepSpeed, the same model and global batch
    (the example's tiny GPT-2, built by its class: the weights saved_gpt2 holds)."""
    from hf_trainer_jobs import run_trainer

    spec = {"deepspeed": None, "micro": GLOBAL_BATCH, "max_steps": STEPS}
    spec["output_dir"] = str(tmp_path_factory.mktemp("reference"))
    return run_trainer(spec)["losses"]


@pytest.fixture(scope="module")
def zero3_launch(saved_gpt2, tmp_path_factory):
    """zero3_launch(end): the launch of the guide, half-precision and trainer scripts at that
    end of the transformers range (tests/hf_zero3_jobs.py), once per module; its output and
    folder (reports/guide, reports/half, zero3/summary.json)."""
    launched, failed = {}, {}

    def launch(end: str) -> tuple[str, Path]:
        if end in failed:  # one failed launch fails its three tests, not three launches
            raise failed[end]
        if end not in launched:
            paths = _transformers_paths(end)
            folder = tmp_path_factory.mktemp(f"zero3_{end}")
            arguments = [
                "--deepspeed", str(_trainer_config(folder)),
                "--output_dir", str(folder / "zero3"),
                "--per_device_train_batch_size", str(GLOBAL_BATCH // WORLD),
                "--max_steps", str(STEPS),
                "--learning_rate", "1e-3",
                "--logging_steps", "1",
                "--save_strategy", "no",
                "--report_to", "none",
                "--disable_tqdm", "true",
                "--dataloader_pin_memory", "false",
            ]  # fmt: skip
            try:
                output = _launch(
                    TESTS / "hf_zero3_jobs.py", arguments, paths, folder,
                    MODEL_DIR=str(saved_gpt2), REPORT_DIR=str(folder / "reports"),
                )  # fmt: skip
            except AssertionError as error:
                failed[end] = error
                raise
            launched[end] = (output, folder)
        return launched[end]

    return launch


@pytest.mark.parametrize("end", ["newest", "lowest"])
def test_run_clm_shaped_trainer_script_at_zero3_matches_one_process(
    one_process_reference, zero3_launch, end
):
    """The run_clm.py order (TrainingArguments with ``--deepspeed`` first, then
    ``from_pretrained``) under the alias at ZeRO-3 on 2 ranks: the model is partitioned when
    ``from_pretrained`` returns, and the Trainer's losses equal transformers' Trainer in one
    process, without DeepSpeed, on the same global batch within 1e-5."""
    output, folder = zero3_launch(end)
    assert (folder / "zero3" / "summary.json").is_file(), output[-8000:]
    summary = json.loads((folder / "zero3" / "summary.json").read_text())
    assert summary["world_size"] == WORLD
    assert summary["partitioned_at_construction"], output[-4000:]
    assert len(summary["losses"]) == STEPS
    assert summary["losses"] == pytest.approx(one_process_reference, abs=1e-5, rel=0)


@pytest.mark.parametrize("end", ["newest", "lowest"])
def test_half_precision_construction_is_partitioned_and_equals_the_cast(
    saved_gpt2, zero3_launch, end
):
    """bf16 and fp16 stage-3 configs, ``from_pretrained(..., dtype=)`` and ``from_config``: every
    parameter partitioned at construction, its shard in that dtype, and gathered equal to the
    saved fp32 weights cast to it (what transformers gives without ZeRO) bit for bit."""
    from safetensors.torch import load_file

    output, folder = zero3_launch(end)
    reports = folder / "reports" / "half"
    assert "[ERROR]" not in output, output[-8000:]
    ranks = [json.loads((reports / f"rank{r}.json").read_text()) for r in range(WORLD)]
    expected = {name for name in load_file(str(saved_gpt2 / "model.safetensors"))}
    expected.discard("lm_head.weight")  # tied to the input embedding
    for report in ranks:
        assert report["deepspeed_module"] == "deepspeed_cpp"
        assert report["transformers"] == _transformers_version(end)
        for key, dtype in (("bf16", "torch.bfloat16"), ("fp16", "torch.float16")):
            pretrained = report[key]["from_pretrained"]
            assert set(pretrained) == expected
            for name, entry in pretrained.items():
                assert entry == {"partitioned": True, "shard_dtype": dtype, "equals_cast": True}, (
                    key, name, entry,
                )  # fmt: skip
            for name, entry in report[key]["from_config"].items():
                assert entry["partitioned"] and entry["dtype"] == dtype, (key, name, entry)
    for key in ("bf16", "fp16"):
        assert ranks[0][key]["from_config"] == ranks[1][key]["from_config"], key
