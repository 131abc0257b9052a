"""transformers' ZeRO-3 construction in half precision under deepspeed_cpp's alias: for each of
bf16 and fp16, a stage-3 ``HfDeepSpeedConfig`` with that mixed precision kept alive, then
``from_pretrained(MODEL_DIR, dtype=...)`` and ``from_config(config, dtype=...)``:

    MODEL_DIR=saved_gpt2 REPORT_DIR=out python -m deepspeed_cpp.launcher --num_gpus 2 \
        --alias-deepspeed tests/hf_zero3_half_job.py

Each rank writes ``REPORT_DIR/rank<N>.json``: per dtype and parameter, whether it was partitioned
at construction, its shard's dtype, and whether its gathered value equals the saved fp32 tensor
cast to that dtype (``from_pretrained``) bit for bit; for ``from_config``, the dtype and a digest
of the gathered values (the ranks must agree)."""

import json
import os
from pathlib import Path

import deepspeed
import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations import HfDeepSpeedConfig

MODEL_DIR = os.environ["MODEL_DIR"]
REPORT_DIR = Path(os.environ["REPORT_DIR"])
PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}

deepspeed.init_distributed()
rank = torch.distributed.get_rank()
saved = load_file(str(Path(MODEL_DIR) / "model.safetensors"))
report = {"deepspeed_module": deepspeed.__name__, "transformers": transformers.__version__}
for key, dtype in PRECISIONS.items():
    ds_config = {
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": 1,
        key: {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    dschf = HfDeepSpeedConfig(ds_config)  # keep this object alive
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=dtype)
    pretrained = {}
    for name, param in model.named_parameters():
        entry = {
            "partitioned": hasattr(param, "ds_id") and param.numel() == 0,
            "shard_dtype": str(param.ds_tensor.dtype) if hasattr(param, "ds_tensor") else None,
        }
        with deepspeed.zero.GatheredParameters([param]):
            entry["equals_cast"] = bool(torch.equal(param.data, saved[name].to(dtype)))
        pretrained[name] = entry
    fresh = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(MODEL_DIR), dtype=dtype)
    from_config = {}
    for name, param in fresh.named_parameters():
        entry = {"partitioned": hasattr(param, "ds_id") and param.numel() == 0}
        with deepspeed.zero.GatheredParameters([param]):
            entry["dtype"] = str(param.data.dtype)
            values = param.data.double()
            entry["digest"] = [values.sum().item(), values.square().sum().item()]
        from_config[name] = entry
    report[key] = {"from_pretrained": pretrained, "from_config": from_config}
    del dschf
REPORT_DIR.mkdir(parents=True, exist_ok=True)
(REPORT_DIR / f"rank{rank}.json").write_text(json.dumps(report))
