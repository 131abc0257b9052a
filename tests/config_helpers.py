"""Helpers shared by the ds_config tests (test_config*.py); the ``ds_log`` fixture they use is in
conftest.py."""

import logging

import pytest

from deepspeed_cpp.runtime.config import DeepSpeedConfig, DeepSpeedConfigError


def warnings_about(caplog, key: str) -> list[str]:
    """The warnings captured (``ds_log``) that name ``key`` in quotes."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and f"'{key}'" in r.getMessage()
    ]


def config_error(config, world_size=None) -> str:
    """The message of the ``DeepSpeedConfigError`` (a ValueError) that parsing ``config``, and
    finalising it for ``world_size`` ranks when given, raises."""
    with pytest.raises(DeepSpeedConfigError) as caught:
        parsed = DeepSpeedConfig.parse(config)
        if world_size is not None:
            parsed.finalize(world_size)
    assert isinstance(caught.value, ValueError)
    return str(caught.value)


def with_batch(**sections) -> dict:
    """A config of ``sections`` with a batch size, the one key every config needs."""
    return {"train_batch_size": 8, **sections}
