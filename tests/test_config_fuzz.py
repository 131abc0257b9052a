"""Random configs built from every key the schema and the key policy know, with values of every
JSON type (and NaN, inf, huge and negative numbers, "auto"): ``DeepSpeedConfig.load`` returns a
config or raises DeepSpeedConfigError, never any other exception. Seeded by the test seed
(conftest), so a failure is reproduced with DS_TEST_SEED."""

from __future__ import annotations

import copy
import logging
import random

import pytest
import torch

from deepspeed_cpp.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
from deepspeed_cpp.runtime.config.deepspeed_config import _known_key_paths

VALUES = [
    None, True, False, 0, 1, -1, 2, 3, 4, 7, 4096, 1 << 20, 2**31, 2**70, 0.5, -0.5, 1.5, 1e-8,
    1e9, float("nan"), float("inf"), -float("inf"), "auto", "", "x", "1e3", "true", "cpu", "nvme",
    "none", "Adam", "AdamW", "SGD", "WarmupLR", [], [0.9, 0.999], [1, 2, 3], {},
    {"enabled": True}, {"device": "cpu"},
]  # fmt: skip
OPTIMIZERS = ["Adam", "AdamW", "SGD", "Lamb", 5]
SCHEDULERS = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"]
CONFIGS = 3000


def _put(config: dict, path: str, value) -> None:
    node = config
    *parents, key = path.split(".")
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[key] = value


def random_config(rng: random.Random, paths: list[str]) -> dict:
    config: dict = {"train_batch_size": rng.choice([8, 16, "auto", 3])}
    if rng.random() < 0.7:
        config["optimizer"] = {"type": rng.choice(OPTIMIZERS), "params": {}}
    if rng.random() < 0.5:
        config["scheduler"] = {"type": rng.choice(SCHEDULERS), "params": {}}
    for _ in range(rng.randint(1, 6)):
        # A copy each time: a shared dict would be filled in later and end up in itself.
        _put(config, rng.choice(paths), copy.deepcopy(rng.choice(VALUES)))
    return config


def test_random_configs_load_or_raise_a_config_error():
    rng = random.Random(int(torch.randint(0, 2**31, (1,))))
    paths = sorted(_known_key_paths())
    logger = logging.getLogger("deepspeed_cpp")
    level = logger.level
    logger.setLevel(logging.ERROR)  # thousands of accepted-but-ignored keys
    outcomes = {"loaded": 0, "refused": 0}
    try:
        for _ in range(CONFIGS):
            config = random_config(rng, paths)
            try:
                DeepSpeedConfig.load(config, world_size=rng.choice([1, 2, 4]))
                outcomes["loaded"] += 1
            except DeepSpeedConfigError as error:
                assert str(error), config
                outcomes["refused"] += 1
            except Exception as error:  # noqa: BLE001 - the property under test
                pytest.fail(f"{type(error).__name__}: {error}\nfrom the config {config!r}")
    finally:
        logger.setLevel(level)
    assert outcomes["loaded"] > 0 and outcomes["refused"] > 0, outcomes


def test_offloading_the_optimizer_at_stage_0_is_a_config_error():
    """Found by the engine-level fuzzing: it was a ValueError from the engine's constructor."""
    zero = {"stage": 0, "offload_optimizer": {"device": "cpu"}}
    with pytest.raises(DeepSpeedConfigError, match="needs ZeRO stage 1, 2 or 3"):
        DeepSpeedConfig.load({"train_batch_size": 4, "zero_optimization": zero})
