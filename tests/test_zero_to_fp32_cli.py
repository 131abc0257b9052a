"""The Hugging Face DeepSpeed guide's recovery commands as written: ``zero_to_fp32.py`` beside
``latest`` in a folder saved by 2 gloo ranks, and the command line's DeepSpeed 0.19 arguments
(``checkpoint_dir output_dir``, ``--safe_serialization``, ``--max_shard_size``, ``-t``,
``--exclude_frozen_parameters``, ``-d``) next to its one-file form. Real files, real
subprocesses."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import torch
import torch.distributed as dist
from checkpoint_training import build_engine, global_batches, train
from dist_pool import shared_pool
from launch_helpers import ZERO_TO_FP32, finish, run_module_at_once, start_python

from deepspeed_cpp.runtime.checkpoint.layout import METADATA_FILE
from deepspeed_cpp.runtime.checkpoint.recovery_script import SCRIPT, write_recovery_script
from deepspeed_cpp.utils.weight_files import parse_size, plan_shards
from deepspeed_cpp.utils.zero_to_fp32 import main

FROZEN = {"frozen.weight", "frozen.bias"}


def save_job(directory: str, seed: int):
    """ZeRO-3 training of two steps, saved as the HF Trainer saves (into checkpoint-N/); rank 0
    returns the engine's consolidated state (every parameter gathered whole)."""
    engine = build_engine(seed, dist.get_world_size(), 3)
    train(engine, global_batches(seed, 2))
    engine.save_checkpoint(directory)
    state = engine.full_module_state_dict(rank0_only=True)
    return {name: tensor.detach().clone() for name, tensor in state.items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run") / "checkpoint-2"
    state = shared_pool(2).run(save_job, str(folder), int(torch.randint(0, 2**30, (1,))))[0]
    return folder, state


def _python(*args: str, cwd, **env) -> subprocess.CompletedProcess:
    return finish(start_python(*args, cwd=cwd, **env))


def _command(*args: str, cwd) -> subprocess.CompletedProcess:
    return _python("-m", ZERO_TO_FP32, *args, cwd=cwd)


def _ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _one_line_error(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zero_to_fp32: "), done.stderr
    return lines[0]


def _assert_same(loaded: dict, expected: dict, where: str) -> None:
    assert set(loaded) == set(expected), where
    for name, tensor in expected.items():
        assert loaded[name].dtype == torch.float32, (where, name)
        assert torch.equal(loaded[name], tensor), (where, name)


def _read_directory(folder, safe: bool) -> tuple[dict, dict | None]:
    """The whole state read back from an output directory, and its index (None: one file)."""
    from safetensors.torch import load_file

    def read(path):
        return load_file(path) if safe else torch.load(path, weights_only=True)

    index_path = folder / (
        "model.safetensors.index.json" if safe else "pytorch_model.bin.index.json"
    )
    if not index_path.exists():
        return read(folder / ("model.safetensors" if safe else "pytorch_model.bin")), None
    index = json.loads(index_path.read_text())
    state = {}
    for file_name in sorted(set(index["weight_map"].values())):
        shard = read(folder / file_name)
        assert all(index["weight_map"][name] == file_name for name in shard), file_name
        state.update(shard)
    return state, index


def test_save_writes_the_script_beside_latest_and_it_runs_from_the_folder(saved, tmp_path):
    folder, state = saved
    assert sorted(os.listdir(folder)) == ["global_step2", "latest", "zero_to_fp32.py"]
    script = folder / "zero_to_fp32.py"
    assert script.read_text() == SCRIPT and os.access(script, os.X_OK)
    # Outside the tag folder: in no file list, so no digest of the checkpoint covers it.
    meta = json.loads((folder / "global_step2" / METADATA_FILE).read_text())
    assert "zero_to_fp32.py" not in {entry["name"] for entry in meta["files"]}
    assert write_recovery_script(folder) is False  # unchanged: not rewritten by the next save

    # Five independent runs, each with its own output (or none), started together.
    directory_form = start_python("zero_to_fp32.py", ".", "fp32", cwd=folder)
    file_form = start_python("zero_to_fp32.py", ".", "pytorch_model.bin", cwd=folder)
    aliased = start_python(
        "-m", "deepspeed_cpp.compat", str(script), str(folder), "aliased", "--safe_serialization",
        cwd=tmp_path,
    )  # fmt: skip
    help_text = start_python("zero_to_fp32.py", "-h", cwd=folder)
    without_package = start_python("-S", str(script), ".", "out", cwd=folder, PYTHONPATH="")
    # The guide's command, from inside checkpoint-N, into an output directory (DeepSpeed 0.19).
    out = _ok(finish(directory_form))
    assert "wrote" in out
    loaded, index = _read_directory(folder / "fp32", safe=False)
    assert index is None
    _assert_same(loaded, state, "script, directory form")
    assert loaded["head2.weight"].data_ptr() == loaded["head.weight"].data_ptr()  # tie kept
    # The guide's older spelling, one file; and the script with the alias, from elsewhere.
    _ok(finish(file_form))
    _assert_same(torch.load(folder / "pytorch_model.bin", weights_only=True), state, "file")
    _ok(finish(aliased))
    _assert_same(_read_directory(tmp_path / "aliased", safe=True)[0], state, "alias, safetensors")
    usage = _ok(finish(help_text))
    assert usage.startswith("usage: zero_to_fp32.py") and "--max_shard_size" in usage
    # A Python that cannot import deepspeed_cpp: one line saying what to install.
    bare = finish(without_package)
    assert bare.returncode == 1
    lines = bare.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot import deepspeed_cpp" in lines[0], bare.stderr
    assert "install deepspeed_cpp" in lines[0]


@pytest.mark.parametrize("safe", [False, True], ids=["torch", "safetensors"])
def test_directory_form_shards_with_deepspeeds_file_names(saved, tmp_path, safe):
    folder, state = saved
    flag = ["--safe_serialization"] if safe else []
    output = tmp_path / "out"
    _ok(_command(str(folder), str(output), "--max_shard_size", "1KB", *flag, cwd=tmp_path))
    loaded, index = _read_directory(output, safe)
    _assert_same(loaded, state, "shards")
    stem, extension = ("model", "safetensors") if safe else ("pytorch_model", "bin")
    shards = sorted(set(index["weight_map"].values()))
    count = len(shards)
    assert count >= 3, shards
    assert shards == [f"{stem}-{i:05d}-of-{count:05d}.{extension}" for i in range(1, count + 1)]
    assert set(index["weight_map"]) == set(state)
    assert sorted(os.listdir(output)) == sorted([*shards, f"{stem}.{extension}.index.json"])
    stored = set(state) if safe else set(state) - {"head2.weight"}  # torch keeps the tie
    assert index["metadata"] == {"total_size": sum(state[n].nbytes for n in stored)}
    for file_name in shards:  # each shard within the limit, unless one tensor alone passes it
        names = [n for n, f in index["weight_map"].items() if f == file_name and n in stored]
        assert len(names) == 1 or sum(state[n].nbytes for n in names) <= 1000, names
    # Converted again without sharding (default 5GB): one file; the old index and shards go,
    # since from_pretrained would read them before the new file.
    _ok(_command(str(folder), str(output), *flag, cwd=tmp_path))
    assert os.listdir(output) == [f"{stem}.{extension}"]
    _assert_same(_read_directory(output, safe)[0], state, "unsharded")


def test_file_form_existing_directory_options_and_errors(saved, tmp_path, monkeypatch, capsys):
    folder, state = saved
    (tmp_path / "existing.bin").mkdir()
    (tmp_path / "weights").write_bytes(b"old")
    # Each command writes its own output (or nothing): all run at once.
    frozen_options = start_python(
        "-m", "deepspeed_cpp.compat", "-m", "deepspeed.utils.zero_to_fp32", str(folder),
        "trainable", "-t", "global_step2", "--exclude_frozen_parameters", "-d", cwd=tmp_path,
    )  # fmt: skip
    existing_dir, safetensors_file, existing_file = run_module_at_once(
        ZERO_TO_FP32,
        (str(folder), str(tmp_path / "existing.bin")),
        (str(folder), "model.safetensors", "--safe_serialization"),
        (str(folder), "weights"),
        cwd=tmp_path,
    )
    # The refusals through the same main() in this process (the command lines above and the
    # other tests run it as `python -m`): status 1, one line on stderr, nothing written.
    monkeypatch.chdir(tmp_path)
    errors = []
    for argv in (
        [str(folder), "x.bin", "--max_shard_size", "1GB"],
        [str(folder), "d", "--max_shard_size", "5XB"],
        [str(tmp_path / "nowhere"), "d"],
        [str(folder), "d", "-t", "global_step9"],
    ):
        status = main(argv)
        captured = capsys.readouterr()
        errors.append(subprocess.CompletedProcess(argv, status, captured.out, captured.err))
    # An existing directory is an output directory (it used to die with IsADirectoryError).
    _ok(existing_dir)
    _assert_same(_read_directory(tmp_path / "existing.bin", False)[0], state, "existing dir")
    # -t, --exclude_frozen_parameters, -d, through `python -m deepspeed_cpp.compat -m deepspeed...`
    out = _ok(finish(frozen_options))
    trainable = {n: t for n, t in state.items() if n not in FROZEN}
    _assert_same(_read_directory(tmp_path / "trainable", False)[0], trainable, "trainable")
    assert "zero_to_fp32: mid.weight -> pytorch_model.bin" in out
    # The one-file form: a new path with a weight-file suffix, or an existing file.
    _ok(safetensors_file)
    from safetensors.torch import load_file

    _assert_same(load_file(tmp_path / "model.safetensors"), state, "one safetensors file")
    _ok(existing_file)
    _assert_same(torch.load(tmp_path / "weights", weights_only=True), state, "existing file")

    shard_of_a_file, bad_size, no_latest, no_tag = (_one_line_error(e) for e in errors)
    assert "max_shard_size applies to an output directory" in shard_of_a_file
    assert "x.bin" in shard_of_a_file
    assert "'5XB' is not a size" in bad_size
    assert "nowhere/latest does not exist and no tag was given" in no_latest
    assert "global_step9" in no_tag
    assert not (tmp_path / "x.bin").exists() and not (tmp_path / "d").exists()


def test_shard_plan_is_huggingface_hubs():
    """Same files, same names in each, same total as huggingface_hub's splitter (what DeepSpeed's
    zero_to_fp32 calls), over sizes around the limit, one tensor over it and a tied pair."""
    hub = pytest.importorskip("huggingface_hub")
    generator = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 400, (40,), generator=generator).tolist() + [1500, 3, 250]
    state = {f"t{i}": torch.zeros(n) for i, n in enumerate(sizes)}
    state["tied"] = state["t5"]
    for limit in ("1KB", "2KB", "10KB", "1MB"):
        ours = plan_shards(state, parse_size(limit), safe_serialization=False)
        theirs = hub.split_torch_state_dict_into_shards(
            state, filename_pattern="pytorch_model{suffix}.bin", max_shard_size=limit
        )
        assert ours.files == theirs.filename_to_tensors, limit
        assert ours.total_size == theirs.metadata["total_size"], limit
    assert parse_size("5GB") == 5 * 10**9 and parse_size("1.5kb") == 1500
    assert re.fullmatch(r"\d+", str(parse_size(123)))
