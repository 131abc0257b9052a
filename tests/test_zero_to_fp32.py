"""deepspeed_cpp.utils.zero_to_fp32: consolidating checkpoints saved by real gloo groups, with no
engine and no process group in the consolidating process."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from checkpoint_training import HIDDEN, build_engine, global_batches, make_model, train
from conftest import REPO_ROOT
from launch_helpers import ZERO_TO_FP32, run_module_at_once

from deepspeed_cpp.runtime.checkpoint import CheckpointMismatchError, CheckpointNotFoundError
from deepspeed_cpp.utils.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)

PYTHON = sys.executable


def save_job(directory: str, stage: int, dtype: str, seed: int):
    """Trains a few steps, saves; returns the module's state and, for an independent rebuild of
    the fp32 masters, this rank's master slices with the bucket plan they come from."""
    engine = build_engine(seed, dist.get_world_size(), stage, dtype)
    train(engine, global_batches(seed, 3))
    engine.save_checkpoint(directory)
    zero = engine.optimizer
    names = {id(p): n for n, p in engine.module.named_parameters()}
    return {
        "state_dict": {n: t.detach().clone() for n, t in engine.module.state_dict().items()},
        "masters": [m.detach().clone() for m in zero.masters],
        "owned": zero.owned_ranges(),
        "plan": [(names[id(p)], zero.plan.param_bucket[i], zero.plan.param_offset[i], p.shape)
                 for i, p in enumerate(zero.params)],
        "bucket_sizes": zero.plan.bucket_sizes,
    }  # fmt: skip


def masters_from_ranks(results: list[dict]) -> dict[str, torch.Tensor]:
    """Each parameter's fp32 master, put together from every rank's live slices."""
    fulls = [torch.zeros(size) for size in results[0]["bucket_sizes"]]
    for result in results:
        for bucket, ((start, size), master) in enumerate(zip(result["owned"], result["masters"])):
            fulls[bucket][start : start + size] = master
    return {
        name: fulls[bucket][offset : offset + shape.numel()].view(shape)
        for name, bucket, offset, shape in results[0]["plan"]
    }


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_consolidation_equals_the_model_parameters(pool3, tmp_path, stage):
    seed = int(torch.randint(0, 2**30, (1,)))
    results = pool3.run(save_job, str(tmp_path), stage, "fp32", seed)
    model_state = results[0]["state_dict"]
    consolidated = get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    assert list(consolidated) == list(model_state)  # every name, in the model's order
    for name, tensor in model_state.items():
        assert consolidated[name].dtype == torch.float32, name
        assert torch.equal(consolidated[name], tensor), name
    # The tied weight is one tensor under both names; the frozen layer and the buffer are there.
    assert consolidated["head2.weight"] is consolidated["head.weight"]
    assert "frozen.weight" in consolidated and "offset" in consolidated
    # A tag directory works as well as the save directory, and so does an explicit tag.
    by_tag = get_fp32_state_dict_from_zero_checkpoint(tmp_path, tag="global_step3")
    in_tag_dir = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "global_step3")
    for name in model_state:
        assert torch.equal(by_tag[name], consolidated[name])
        assert torch.equal(in_tag_dir[name], consolidated[name])


def test_bf16_consolidation_is_the_fp32_masters(pool3, tmp_path):
    seed = int(torch.randint(0, 2**30, (1,)))
    results = pool3.run(save_job, str(tmp_path), 2, "bf16", seed)
    masters = masters_from_ranks(results)
    consolidated = get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    model_state = results[0]["state_dict"]
    more_precise = 0
    for name, master in masters.items():
        assert torch.equal(consolidated[name], master), name
        # The model trains with these masters rounded to bf16.
        assert torch.equal(consolidated[name].bfloat16(), model_state[name]), name
        more_precise += int(not torch.equal(master, model_state[name].float()))
    assert more_precise == len(masters), "fp32 masters carry bits the bf16 weights lack"
    assert consolidated["frozen.weight"].dtype == torch.float32
    assert torch.equal(consolidated["frozen.weight"], model_state["frozen.weight"].float())
    # Buffers as saved: bf16 training casts parameters only, so the buffer stayed float32.
    assert consolidated["offset"].dtype == model_state["offset"].dtype == torch.float32
    assert torch.equal(consolidated["offset"], model_state["offset"])
    assert consolidated["head2.weight"] is consolidated["head.weight"]


def test_command_writes_torch_and_safetensors(pool3, tmp_path):
    from safetensors.torch import load_file

    seed = int(torch.randint(0, 2**30, (1,)))
    checkpoint = tmp_path / "checkpoints"
    pool3.run(save_job, str(checkpoint), 2, "fp32", seed)
    expected = get_fp32_state_dict_from_zero_checkpoint(checkpoint)

    torch_file, safe_file = tmp_path / "pytorch_model.bin", tmp_path / "model.safetensors"
    # Started together, one core each. (A missing checkpoint's one-line error is checked through
    # the same main() in tests/test_zero_to_fp32_cli.py.)
    to_torch, to_safetensors = run_module_at_once(
        ZERO_TO_FP32,
        (str(checkpoint), str(torch_file)),
        (str(checkpoint), str(safe_file), "--safe_serialization", "--tag", "global_step3"),
        cwd=tmp_path,
    )
    assert to_torch.returncode == 0, to_torch.stderr
    assert "wrote" in to_torch.stdout
    assert to_safetensors.returncode == 0, to_safetensors.stderr
    from_torch = torch.load(torch_file, weights_only=True)
    from_safetensors = load_file(safe_file)
    assert list(from_torch) == list(expected)
    assert set(from_safetensors) == set(expected)  # tied names included, each with its values
    for name, tensor in expected.items():
        assert torch.equal(from_torch[name], tensor), name
        assert torch.equal(from_safetensors[name], tensor), name
    assert from_torch["head2.weight"].data_ptr() == from_torch["head.weight"].data_ptr()

    # load_state_dict_from_zero_checkpoint fills a fresh model, and refuses another model.
    model = load_state_dict_from_zero_checkpoint(make_model(seed + 1), checkpoint)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    with pytest.raises(CheckpointMismatchError, match=r"'offset': the checkpoint has shape"):
        load_state_dict_from_zero_checkpoint(make_model(0, hidden=HIDDEN + 2), checkpoint)
    with pytest.raises(CheckpointNotFoundError, match="global_step42 does not exist"):
        convert_zero_checkpoint_to_fp32_state_dict(checkpoint, tmp_path / "x.bin", "global_step42")


class Wide(torch.nn.Module):
    """~10M parameters: enough for the memory of the consolidation to be measured."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(1100, 1100) for _ in range(8)])

    def forward(self, x):
        return self.layers(x)


def wide_save_job(directory: str):
    import deepspeed_cpp as deepspeed

    torch.manual_seed(0)
    model = Wide()
    config = {"gradient_clipping": 0.0, "train_batch_size": 3, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.backward(engine(torch.randn(1, 1100)).square().mean())
    engine.step()
    engine.save_checkpoint(directory)


# Runs the command's main() in a fresh process after its imports, and prints how far its resident
# memory rose above what it was once imported (Linux: "5" in clear_refs resets the peak to now).
MEASURE_COMMAND = """
import sys
from deepspeed_cpp.utils import zero_to_fp32

def status_bytes(key):
    with open("/proc/self/status") as status:
        return next(int(l.split()[1]) * 1024 for l in status if l.startswith(key))

with open("/proc/self/clear_refs", "w") as clear_refs:
    clear_refs.write("5")
before = status_bytes("VmRSS:")
code = zero_to_fp32.main(sys.argv[1:])
print("rise", status_bytes("VmHWM:") - before)
sys.exit(code)
"""


def test_command_memory_stays_near_the_output_size(pool3, tmp_path):
    checkpoint = tmp_path / "checkpoints"
    pool3.run(wide_save_job, str(checkpoint))
    output = tmp_path / "wide.bin"
    done = subprocess.run(
        [PYTHON, "-c", MEASURE_COMMAND, str(checkpoint), str(output)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rise = int(done.stdout.split("rise")[-1])
    size = output.stat().st_size
    checkpoint_bytes = sum(f.stat().st_size for f in (checkpoint / "global_step1").iterdir())
    print(
        f"\nzero_to_fp32: output {size / 2**20:.1f} MiB, checkpoint {checkpoint_bytes / 2**20:.1f}"
        f" MiB, peak resident memory {rise / 2**20:.1f} MiB above the imports "
        f"({rise / size:.2f}x the output)"
    )
    # A sanity bound only (benchmarks/bench_zero_to_fp32.py measures): loading the checkpoint
    # at once would take 4x the output (module file, masters, two Adam moments) and more.
    assert rise < 2.5 * size
