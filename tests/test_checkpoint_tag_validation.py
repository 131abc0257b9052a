"""``checkpoint.tag_validation``, DeepSpeed's rule for ranks that pass different tags to
``save_checkpoint`` (``runtime/checkpoint/tag_agreement.py``), on a real 2-rank ZeRO-1 engine:
"FAIL" raises on every rank (an ``AssertionError``, as DeepSpeed's) and writes nothing; "WARN"
(the default) and "IGNORE" save the whole checkpoint under rank 0's tag, which loads back.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from deepspeed_cpp.runtime.config import DeepSpeedConfig
from deepspeed_cpp.runtime.config.errors import DeepSpeedConfigError


def _config(mode: str | None) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 1},
    }
    if mode is not None:
        config["checkpoint"] = {"tag_validation": mode}
    return config


def tag_job(save_dir: str, mode: str | None, seed: int):
    import torch.distributed as dist

    import deepspeed_cpp as deepspeed
    from deepspeed_cpp.runtime.checkpoint.tag_agreement import CheckpointTagMismatchError

    rank = dist.get_rank()
    torch.manual_seed(seed)
    model = torch.nn.Linear(6, 3)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=_config(mode)
    )
    generator = torch.Generator().manual_seed(seed + rank)

    def step():
        loss = engine(torch.randn(2, 6, generator=generator)).square().mean()
        engine.backward(loss)
        engine.step()

    step()
    heard = []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())
    logging.getLogger("deepspeed_cpp").addHandler(handler)
    try:
        # Tags of different lengths: the mismatch path gathers them padded (tag_agreement.py).
        engine.save_checkpoint(save_dir, tag="tag-0" if rank == 0 else "tag-1-longer")
    except CheckpointTagMismatchError as error:
        assert isinstance(error, AssertionError) and isinstance(error, ValueError)
        return {"raised": str(error), "files": sorted(os.listdir(save_dir))}
    finally:
        logging.getLogger("deepspeed_cpp").removeHandler(handler)
    saved = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    step()
    changed = any(not torch.equal(p, saved[n]) for n, p in engine.module.named_parameters())
    engine.load_checkpoint(save_dir)
    restored = all(torch.equal(p, saved[n]) for n, p in engine.module.named_parameters())
    return {
        "files": sorted(os.listdir(save_dir)),
        "latest": open(os.path.join(save_dir, "latest")).read().strip(),
        "changed": changed,
        "restored": restored,
        "warned": [m for m in heard if "different tags" in m],
    }


def test_tag_validation_modes_on_two_ranks(pool2, tmp_path):
    seed = int(torch.randint(0, 2**30, (1,)))
    for mode in ("FAIL", "warn", None, "Ignore"):
        save_dir = tmp_path / str(mode)
        save_dir.mkdir()
        results = pool2.run(tag_job, str(save_dir), mode, seed)
        if mode == "FAIL":
            for result in results:
                assert "['tag-0', 'tag-1-longer']" in result["raised"], result
                assert result["files"] == [], result  # nothing staged or published
            continue
        for rank, result in enumerate(results):
            tags = [f for f in result["files"] if f.startswith("tag")]
            assert tags == ["tag-0"] and "latest" in result["files"], (mode, result)
            assert result["latest"] == "tag-0"
            assert result["changed"] and result["restored"], (mode, result)
            if rank == 0:  # the warning comes from every rank; rank 0's logger is checked
                assert len(result["warned"]) == 1 and "'tag-0'" in result["warned"][0], result


def test_tag_validation_value_is_checked_and_case_free():
    assert DeepSpeedConfig.load(_config(None)).checkpoint.tag_validation == "WARN"
    assert DeepSpeedConfig.load(_config("fail")).checkpoint.tag_validation == "FAIL"
    assert DeepSpeedConfig.load(_config("Ignore")).checkpoint.tag_validation == "IGNORE"
    with pytest.raises(DeepSpeedConfigError, match=r"checkpoint\.tag_validation.*'WARN'"):
        DeepSpeedConfig.load(_config("foo"))
    # DeepSpeed's top-level names, which its own tests use for this refusal.
    import deepspeed_cpp

    assert deepspeed_cpp.DeepSpeedConfigError is DeepSpeedConfigError
    assert deepspeed_cpp.DeepSpeedConfig is DeepSpeedConfig
