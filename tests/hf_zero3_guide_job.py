"""The Hugging Face guide's non-Trainer ZeRO-3 pattern, as its users write it (``import deepspeed``,
transformers' own ``HfDeepSpeedConfig`` and ``from_pretrained``), run under deepspeed_cpp's alias:

    MODEL_DIR=saved_gpt2 REPORT_DIR=out python -m deepspeed_cpp.launcher --num_gpus 2 \
        --alias-deepspeed tests/hf_zero3_guide_job.py

Each rank writes ``REPORT_DIR/rank<N>.json``: for ``from_pretrained``, every parameter's ZeRO-3
state and whether its gathered value equals the saved tensor bit for bit; for ``from_config``,
whether every parameter was partitioned and a digest of its gathered (initialised) value, which
must agree across ranks; and the peak host memory of the ``from_pretrained`` call
(``construction_memory.py``). benchmarks/bench_hf_zero3_construction.py sets ``MEMORY_ONLY``,
``WARMUP_DIR`` and ``ZERO3``.
"""

import json
import os
import sys
from pathlib import Path

import deepspeed
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations import HfDeepSpeedConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from construction_memory import PeakMemory  # noqa: E402

MODEL_DIR = os.environ["MODEL_DIR"]
REPORT_DIR = Path(os.environ["REPORT_DIR"])

ds_config = {
    "gradient_clipping": 0.0,
    "train_micro_batch_size_per_gpu": 1,
    # Every parameter partitioned (the default keeps parameters under 100k elements whole, which
    # would be all of a tiny model's).
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}
if os.environ.get("ZERO3", "1") == "1":  # the benchmark's reference sets 0: no ZeRO-3
    dschf = HfDeepSpeedConfig(ds_config)  # keep this object alive

deepspeed.init_distributed()
rank = torch.distributed.get_rank()
if os.environ.get("WARMUP_DIR"):  # the first from_pretrained imports and maps what it needs
    AutoModelForCausalLM.from_pretrained(os.environ["WARMUP_DIR"])
with PeakMemory() as peak:
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    if os.environ.get("ZERO3") == "0":  # whole weights, mapped from the file until read
        for param in model.parameters():
            param.data.sum()
if os.environ.get("MEMORY_ONLY") == "1":  # the benchmark's large model: no value checks
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    (REPORT_DIR / f"rank{rank}.json").write_text(json.dumps({"memory": peak.report()}))
    sys.exit(0)


def zero_state(param) -> dict:
    return {
        "zero": hasattr(param, "ds_id"),
        "status": param.ds_status.name if hasattr(param, "ds_status") else None,
        "local_numel": param.numel(),
        "shard_numel": param.ds_tensor.numel() if hasattr(param, "ds_tensor") else None,
        "shape": list(getattr(param, "ds_shape", param.shape)),
    }


saved = load_file(str(Path(MODEL_DIR) / "model.safetensors"))
pretrained = {}
for name, param in model.named_parameters():
    entry = zero_state(param)
    with deepspeed.zero.GatheredParameters([param]):
        entry["equals_saved"] = bool(torch.equal(param.data, saved[name]))
    pretrained[name] = entry
tied = model.lm_head.weight is model.transformer.wte.weight

config = AutoConfig.from_pretrained(MODEL_DIR)
fresh = AutoModelForCausalLM.from_config(config)
from_config = {}
for name, param in fresh.named_parameters():
    entry = zero_state(param)
    with deepspeed.zero.GatheredParameters([param]):
        values = param.data.double()
        entry["digest"] = [values.sum().item(), values.square().sum().item()]
    from_config[name] = entry

report = {
    "rank": rank,
    "world_size": torch.distributed.get_world_size(),
    "deepspeed_module": deepspeed.__name__,
    "from_pretrained": pretrained,
    "lm_head_tied": tied,
    "from_config": from_config,
    "memory": peak.report(),
}
REPORT_DIR.mkdir(parents=True, exist_ok=True)
(REPORT_DIR / f"rank{rank}.json").write_text(json.dumps(report))
