"""The opt-in ``import deepspeed`` alias (deepspeed_cpp.compat), in real processes.

Each check runs in a fresh interpreter: the alias changes ``sys.meta_path`` and ``sys.modules``,
which must never leak into the test process (nor into anything but the process that asked).
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from launch_helpers import free_port, launch_env
from safetensors.torch import load_file

from deepspeed_cpp.launcher.local_rank_trampoline import worker_command

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = REPO_ROOT / "examples" / "hf_trainer"
OUR_IMPORT = "from deepspeed_cpp.hf import Trainer, TrainingArguments"
HF_IMPORT = "from transformers import Trainer, TrainingArguments"


def _python(code: str, *, extra_path: Path | None = None, timeout: int = 120):
    path = str(REPO_ROOT) if extra_path is None else f"{extra_path}:{REPO_ROOT}"
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=launch_env(PYTHONPATH=path),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
    )


def _ok(run) -> str:
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return run.stdout


def test_no_deepspeed_without_the_alias():
    # The premise of every test below: this environment has no real DeepSpeed.
    out = _ok(
        _python("""
        import importlib.metadata as md, importlib.util
        print(importlib.util.find_spec("deepspeed"))
        try:
            md.version("deepspeed")
        except md.PackageNotFoundError:
            print("no metadata")
        """)
    )
    assert out.split() == ["None", "no", "metadata"]


# Two round trips through the alias, run one after the other in one fresh interpreter (a start
# costs seconds): the second also shows that activating again after deactivate() works.
FINDER_ROUND_TRIP = """
        import json, sys
        import deepspeed_cpp, deepspeed_cpp.compat as compat
        compat.activate()
        compat.activate()  # idempotent
        import deepspeed
        import deepspeed.moe.layer
        import deepspeed.ops.adam
        import deepspeed.runtime.zero.partition_parameters as pp
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live
        import deepspeed_cpp.moe.layer
        from deepspeed_cpp.optim import DeepSpeedCPUAdam
        import deepspeed_cpp.runtime.zero.partition_parameters as our_pp
        report = {
            "same_package": deepspeed is deepspeed_cpp,
            "same_moe": deepspeed.moe.layer is deepspeed_cpp.moe.layer,
            "same_adam": deepspeed.ops.adam.DeepSpeedCPUAdam is DeepSpeedCPUAdam,
            "same_zero": pp is our_pp,
            "module_name": deepspeed.moe.layer.__name__,
            "initialize": deepspeed.initialize is deepspeed_cpp.initialize,
        }
        try:
            import deepspeed.inference.engine
        except ModuleNotFoundError as error:
            report["missing"] = str(error)
        compat.deactivate()
        report["active_after"] = compat.is_active()
        report["left_in_sys_modules"] = sorted(
            n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")
        )
        try:
            import deepspeed
            report["after"] = "imported"
        except ModuleNotFoundError as error:
            report["after"] = str(error)
        print(json.dumps(report))
"""

METADATA_ROUND_TRIP = """
        import importlib.metadata as md, json, subprocess, sys
        import deepspeed_cpp.compat as compat
        compat.activate()
        from transformers.integrations.deepspeed import is_deepspeed_available
        from transformers.utils.versions import require_version
        require_version("deepspeed>=0.9.3")  # transformers' dep check for its DeepSpeed path
        child = subprocess.run(
            [sys.executable, "-c",
             "import importlib.metadata as md\\n"
             "try:\\n md.version('deepspeed'); print('found')\\n"
             "except md.PackageNotFoundError: print('absent')"],
            capture_output=True, text=True, check=True)
        print(json.dumps({
            "version": md.version("deepspeed"),
            "name": md.distribution("deepspeed").metadata["Name"],
            "transformers_sees_it": is_deepspeed_available(),
            "expected": compat.ALIAS_VERSION,
            "child": child.stdout.strip(),
        }))
        # transformers' own ZeRO-3 construction builds the model under our zero.Init (in one
        # process, a world of one): every parameter is a ZeRO-3 one (test_hf_alias_zero3.py
        # checks the values on 2 ranks).
        import torch.distributed
        from transformers import AutoModelForCausalLM, GPT2Config
        from transformers.integrations.deepspeed import HfDeepSpeedConfig
        keeper = HfDeepSpeedConfig({"zero_optimization": {
            "stage": 3, "stage3_param_persistence_threshold": 0}})
        model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=8, n_head=2))
        print(json.dumps({"zero": all(hasattr(p, "ds_id") for p in model.parameters()),
                          "empty": all(p.numel() == 0 for p in model.parameters())}))
        del keeper, model
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()  # the world of one zero.Init made
        import accelerate.state
        prepare_backend = accelerate.state.PartialState._prepare_backend
        wrapped = hasattr(prepare_backend, "_deepspeed_cpp_original")
        compat.deactivate()
        restored = accelerate.state.PartialState._prepare_backend
        print(json.dumps({"wrapped": wrapped,
                          "restored": restored is prepare_backend._deepspeed_cpp_original}))
        try:
            md.version("deepspeed")
            print("still answered")
        except md.PackageNotFoundError:
            print("gone")
"""


@pytest.fixture(scope="module")
def round_trip_lines() -> list[str]:
    return _ok(_python(FINDER_ROUND_TRIP + METADATA_ROUND_TRIP)).strip().splitlines()


def test_finder_resolves_submodules_and_unresolves(round_trip_lines):
    report = json.loads(round_trip_lines[0])
    assert report["same_package"] and report["same_moe"] and report["same_adam"]
    assert report["same_zero"] and report["initialize"]
    # The module keeps its own name: tracebacks and pickles still say deepspeed_cpp.
    assert report["module_name"] == "deepspeed_cpp.moe.layer"
    assert "'deepspeed.inference'" in report["missing"]
    assert "deepspeed_cpp.inference" in report["missing"]
    assert report["active_after"] is False
    assert report["left_in_sys_modules"] == []
    assert report["after"] == "No module named 'deepspeed'"


def test_metadata_is_answered_only_in_the_activated_process(round_trip_lines):
    line, _, _, after = round_trip_lines[1:]
    report = json.loads(line)
    assert report["version"] == report["expected"]
    assert report["version"].startswith("0.19.8+deepspeed.cpp.")
    assert report["name"] == "deepspeed"
    assert report["transformers_sees_it"] is True
    # A child of the activated process (same environment) does not see it: nothing on disk.
    assert report["child"] == "absent"
    assert after == "gone"


def test_accelerate_backend_choice_is_wrapped_only_while_active(round_trip_lines):
    # accelerate.state was imported after activate(): the finder wrapped its backend choice;
    # deactivate() put accelerate's own back.
    assert json.loads(round_trip_lines[3]) == {"wrapped": True, "restored": True}


def test_transformers_zero3_construction_partitions(round_trip_lines):
    assert json.loads(round_trip_lines[2]) == {"zero": True, "empty": True}


def _fake_real_deepspeed(tmp_path: Path) -> Path:
    package = tmp_path / "site" / "deepspeed"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise SystemExit('the fake deepspeed was imported')\n")
    return tmp_path / "site"


def test_refuses_when_a_real_deepspeed_is_importable(tmp_path):
    site = _fake_real_deepspeed(tmp_path)
    run = _python(
        """
        import sys
        import deepspeed_cpp.compat as compat
        try:
            compat.activate()
        except compat.RealDeepSpeedPresentError as error:
            print("refused:", error)
        print("active:", compat.is_active(), "imported:", "deepspeed" in sys.modules)
        """,
        extra_path=site,
    )
    out = _ok(run)
    assert "refused: deepspeed_cpp.compat.activate(): a real 'deepspeed' is importable" in out
    assert str(site / "deepspeed" / "__init__.py") in out
    assert "active: False imported: False" in out


def test_launcher_refuses_the_alias_beside_a_real_deepspeed(tmp_path):
    site = _fake_real_deepspeed(tmp_path)
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    run = subprocess.run(
        [sys.executable, "-m", "deepspeed_cpp.launcher", "--num_procs", "2",
         "--master_port", str(free_port()), "--alias-deepspeed", str(script)],
        env=launch_env(PYTHONPATH=f"{site}:{REPO_ROOT}"),
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode != 0
    assert "--alias-deepspeed: a real 'deepspeed' is importable" in run.stderr
    assert "ran" not in run.stdout


def test_trampoline_starts_workers_through_the_alias():
    env = {"LOCAL_RANK": "1", "DEEPSPEED_CPP_ALIAS_DEEPSPEED": "1"}
    assert worker_command(["python", "local_rank", "t.py", "-a"], env) == [
        sys.executable, "-u", "-m", "deepspeed_cpp.compat", "t.py", "--local_rank=1", "-a",
    ]  # fmt: skip
    assert worker_command(["module", "no_local_rank", "pkg.t"], env) == [
        sys.executable, "-u", "-m", "deepspeed_cpp.compat", "-m", "pkg.t",
    ]  # fmt: skip


DEEPSPEED_SCRIPT = """\
import argparse, importlib.metadata, json, os, sys
import torch
import deepspeed  # the line a DeepSpeed user cannot change

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int)
parser.add_argument("--out")
args = parser.parse_args()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
    "zero_optimization": {"stage": 2},
})
x = torch.randn(2, 4, generator=torch.Generator().manual_seed(engine.global_rank))
loss = engine(x).pow(2).mean()
engine.backward(loss)
engine.step()
rank = torch.distributed.get_rank()
with open(os.path.join(args.out, f"rank{rank}.json"), "w") as handle:
    json.dump({
        "package": deepspeed.__name__,
        "version": importlib.metadata.version("deepspeed"),
        "world": torch.distributed.get_world_size(),
        "local_rank": args.local_rank,
        "main": __name__,
        "path0": sys.path[0],
        "weight": engine.module.weight.detach().flatten().tolist(),
    }, handle)
"""


def test_launcher_flag_reaches_every_worker(tmp_path):
    script = tmp_path / "scripts" / "train_ds.py"
    script.parent.mkdir()
    script.write_text(DEEPSPEED_SCRIPT)
    run = subprocess.run(
        [sys.executable, "-m", "deepspeed_cpp.launcher", "--num_procs", "2",
         "--master_port", str(free_port()), "--alias-deepspeed", str(script),
         "--out", str(tmp_path)],
        env=launch_env(PYTHONPATH=str(REPO_ROOT)),
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, seen in enumerate(ranks):
        assert seen["package"] == "deepspeed_cpp"
        assert seen["version"].startswith("0.19.8+deepspeed.cpp.")
        assert seen["world"] == 2 and seen["local_rank"] == rank
        # Run as `python train_ds.py` would run it.
        assert seen["main"] == "__main__" and seen["path0"] == str(script.parent)
    # One data-parallel step: both ranks hold the same updated weights.
    assert ranks[0]["weight"] == ranks[1]["weight"]


def _unmodified_script(folder: Path) -> Path:
    """The example script as Hugging Face users have it: transformers' Trainer."""
    ours = (EXAMPLE / "train_tiny_gpt2.py").read_text()
    assert OUR_IMPORT in ours
    script = folder / "train_hf.py"
    script.write_text(ours.replace(OUR_IMPORT, HF_IMPORT))
    return script


def _config(folder: Path, stage: int, offload: bool, tp: int = 1) -> Path:
    """The example's ds_config ("auto" everywhere the guide allows) at ZeRO ``stage``; with
    ``offload`` the optimizer lives on the host, where accelerate swaps the Trainer's AdamW for
    ``deepspeed.ops.adam.DeepSpeedCPUAdam`` (ours) on the same param groups."""
    config = json.loads((EXAMPLE / "ds_config.json").read_text())
    zero = config["zero_optimization"]
    zero["stage"] = stage
    if stage < 3:
        for key in [k for k in zero if k.startswith("stage3_")]:
            del zero[key]
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    if tp > 1:  # transformers calls deepspeed.tp_model_init, accelerate shards data by TP mesh
        config["tensor_parallel"] = {"autotp_size": tp}
    path = folder / f"ds_config_zero{stage}{'_offload' if offload else ''}_tp{tp}.json"
    path.write_text(json.dumps(config))
    return path


def _start_alias_run(
    script: Path, config: Path, output_dir: Path, world: int, tp: int = 1
) -> subprocess.Popen:
    """The script under our launcher with ``--alias-deepspeed`` (``world`` ranks), or with no
    launcher at all (``world`` 1: ``python -m deepspeed_cpp.compat``, which is
    ``deepspeed_cpp.compat.activate()`` before the script, as in a notebook)."""
    if world == 1:
        start = [sys.executable, "-m", "deepspeed_cpp.compat"]
    else:
        start = [
            sys.executable, "-m", "deepspeed_cpp.launcher", "--num_gpus", str(world),
            "--master_port", str(free_port()), "--alias-deepspeed",
        ]  # fmt: skip
    command = [
        *start, str(script),
        "--deepspeed", str(config),
        "--output_dir", str(output_dir),
        # The ranks of a TP group read the same batch.
        "--per_device_train_batch_size", str(ALIAS_GLOBAL_BATCH * tp // world),
        "--max_steps", str(ALIAS_STEPS),
        "--learning_rate", "1e-3",
        "--logging_steps", "1",
        "--save_strategy", "no",
        "--report_to", "none",
        "--disable_tqdm", "true",
        "--dataloader_pin_memory", "false",
    ]  # fmt: skip
    return subprocess.Popen(
        command,
        env=launch_env(PYTHONPATH=str(REPO_ROOT)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=output_dir.parent,
    )


def _finish(run: subprocess.Popen) -> str:
    try:
        output, _ = run.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        run.kill()
        output, _ = run.communicate()
    assert run.returncode == 0, output[-8000:]
    return output


ALIAS_GLOBAL_BATCH = 8
ALIAS_STEPS = 4
# name: (ZeRO stage, optimizer offloaded, processes, tensor-parallel size)
ALIAS_RUNS = {
    "zero2_offload": (2, True, 2, 1),
    "zero3": (3, False, 2, 1),
    "zero2_one_process": (2, False, 1, 1),
    "zero1_tp2": (1, False, 2, 2),
}


def test_unmodified_hf_trainer_script_trains_on_our_engine(tmp_path):
    """transformers' own Trainer with ``--deepspeed`` under the alias: at ZeRO-2 (optimizer
    offloaded), ZeRO-3 and AutoTP 2 (``deepspeed.tp_model_init``) on 2 CPU ranks under the
    launcher, and at ZeRO-2 in one process without a launcher. accelerate's DeepSpeed mode
    drives deepspeed_cpp's engine (no DeepSpeed is installed here, see the first test), and the
    losses and saved weights equal transformers' Trainer in one process on the same global batch
    within 1e-5."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from hf_trainer_jobs import run_trainer

    from deepspeed_cpp.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    script = _unmodified_script(tmp_path)
    outputs = {name: tmp_path / name for name in ALIAS_RUNS}
    # Every run starts at once, and the reference trains in this process meanwhile: on 2 cores
    # most of each run is interpreters importing torch and transformers.
    runs = {
        name: _start_alias_run(
            script, _config(tmp_path, stage, offload, tp), outputs[name], world, tp
        )
        for name, (stage, offload, world, tp) in ALIAS_RUNS.items()
    }
    try:
        reference = run_trainer(
            {
                "output_dir": str(tmp_path / "reference"),
                "deepspeed": None,
                "micro": ALIAS_GLOBAL_BATCH,
                "max_steps": ALIAS_STEPS,
            }
        )
        for run in runs.values():
            _finish(run)
    finally:
        for run in runs.values():
            if run.poll() is None:
                run.terminate()
                run.wait(timeout=60)
    assert len(reference["losses"]) == ALIAS_STEPS
    for name, (_, _, world, _) in ALIAS_RUNS.items():
        summary = json.loads((outputs[name] / "summary.json").read_text())
        # Under the launcher accelerate counted both ranks (without the alias's gloo backend it
        # would count one on each).
        assert summary["world_size"] == world, name
        assert summary["losses"] == pytest.approx(reference["losses"], abs=1e-5, rel=0), name
    # save_model() at ZeRO-2: accelerate's state dict (clone_tensors_for_torch_save), whole.
    for name in ("zero2_offload", "zero2_one_process"):
        saved = load_file(str(outputs[name] / "model.safetensors"))
        assert "transformer.wte.weight" in saved
        for key, value in saved.items():
            torch.testing.assert_close(value, reference["weights"][key], atol=1e-5, rtol=0)
    # At ZeRO-3 and under TP (stage3_gather_16bit_weights_on_model_save false) transformers
    # saves the engine's checkpoint instead (under TP one mp_rank_XX part per TP rank): ours,
    # which zero_to_fp32 consolidates (merging the TP slices).
    for name in ("zero3", "zero1_tp2"):
        assert not (outputs[name] / "model.safetensors").exists()
        consolidated = get_fp32_state_dict_from_zero_checkpoint(outputs[name])
        assert set(consolidated) >= set(saved)
        for key, value in consolidated.items():
            torch.testing.assert_close(value, reference["weights"][key], atol=1e-5, rtol=0)


def test_names_transformers_and_accelerate_read_from_deepspeed_modules():
    # The thin, honest part of the mapping: names that exist in DeepSpeed's modules and mean the
    # same here (accelerate checks VALID_LR_SCHEDULES, transformers imports deepspeed.utils.logger,
    # accelerate's plugin writes steps_per_print = inf to silence the progress line).
    from deepspeed_cpp.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
    from deepspeed_cpp.runtime.lr_schedules import VALID_LR_SCHEDULES
    from deepspeed_cpp.utils import logger

    assert set(VALID_LR_SCHEDULES) == {
        "LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR",
    }  # fmt: skip
    assert logger.name == "deepspeed_cpp"
    assert DeepSpeedConfig.parse({"steps_per_print": float("inf")}).steps_per_print == 0
    assert DeepSpeedConfig.parse({"steps_per_print": 5.0}).steps_per_print == 5
    for bad in (0, float("nan"), -float("inf"), True):
        with pytest.raises(DeepSpeedConfigError, match="an integer >= 1 or infinity"):
            DeepSpeedConfig.parse({"steps_per_print": bad})
    # transformers' save_model reads engine.config as DeepSpeed's dict.
    config = DeepSpeedConfig.parse({"zero_optimization": {"stage": 3}, "gradient_clipping": 0.5})
    assert config.get("zero_optimization", {}).get("stage") == 3
    assert config.get("gradient_clipping") == 0.5
    assert config.get("optimizer", "absent") == "absent"
    config.get("zero_optimization")["stage"] = 1  # a copy: the config is not changed
    assert config.get("zero_optimization")["stage"] == 3


def test_clone_tensors_for_torch_save_copies_views_and_keeps_ties():
    from collections import OrderedDict

    from deepspeed_cpp.checkpoint.utils import clone_tensors_for_torch_save

    flat = torch.randn(3 * 7 + 5)  # a ZeRO bucket: parameters are views of it
    weight, bias = flat[:21].view(3, 7), flat[21:]
    tied = torch.nn.Parameter(torch.randn(4, 2))
    state = OrderedDict(
        [("w", weight), ("b", bias), ("emb", tied), ("head", tied), ("n", 3), ("t", (bias, "x"))]
    )
    copied = clone_tensors_for_torch_save(state)
    assert type(copied) is OrderedDict and list(copied) == list(state)
    for name in ("w", "b", "emb"):
        assert torch.equal(copied[name], state[name])
        assert copied[name].untyped_storage().nbytes() == copied[name].nbytes  # its own storage
        assert not copied[name].requires_grad
    assert copied["w"].data_ptr() != weight.data_ptr()
    assert copied["head"] is copied["emb"], "tied names stay one tensor"
    assert copied["n"] == 3 and copied["t"][1] == "x" and copied["t"][0] is copied["b"]
    flat.add_(1.0)
    assert not torch.equal(copied["w"], weight), "independent of the model's tensors"
