"""``engine.empty_partition_cache()`` (DeepSpeed's engine method, called after evaluation loops)
on a real 2-rank ZeRO-3 engine: afterwards no parameter is whole, the next evaluation gives the
same outputs, and training afterwards matches the single-process reference.

Our coordinator already releases a unit when its module's forward ends under ``no_grad`` (nothing
is held for a backward that will not come), so after these evaluation forwards the method finds
nothing to free; it ends the open pass, which the next forward would otherwise do."""

from __future__ import annotations

import torch
import zero3_helpers as h


def empty_cache_job(config: dict, seed: int, probe: torch.Tensor, steps: int):
    import deepspeed_cpp as deepspeed
    from deepspeed_cpp.runtime.zero import partition_parameters as pp

    engine, _, _, _ = deepspeed.initialize(model=h.make_model(seed), config=config)
    params = list(engine.module.parameters())

    def whole() -> int:
        return sum(0 if pp.is_partitioned(p) else p.ds_numel for p in params)

    engine.eval()
    with torch.no_grad():
        first = engine(probe).clone()
        second = engine(probe).clone()
    engine.empty_partition_cache()
    freed = whole()
    engine.empty_partition_cache()  # nothing left to free: a no-op, still collective-safe
    with torch.no_grad():
        third = engine(probe).clone()
    engine.empty_partition_cache()
    engine.train()
    trained = h.train(engine, seed, steps)
    return {"outs": (first, second, third), "freed": freed, "params": trained}


def test_empty_partition_cache_frees_gathered_parameters(pool2):
    seed, steps = int(torch.randint(0, 2**30, (1,))), 1
    probe = torch.randint(0, h.VOCAB, (5,))
    with h.one_thread(), torch.no_grad():
        expected = h.reference(seed, 0, 1, 2, 0.0)(probe)
    final = h.named_state(h.reference(seed, steps, 1, 2, 0.0))
    for result in pool2.run(empty_cache_job, h.config(threshold=0), seed, probe, steps):
        assert result["freed"] == 0, result
        for out in result["outs"]:
            assert (out - expected).abs().max() <= 1e-6 * expected.abs().max()
        assert h.max_relative_difference(result["params"], final) <= 1e-6
