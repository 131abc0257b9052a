"""Where a ds_config comes from: a path, a dict, ``args.deepspeed_config``, base64 as DeepSpeed's
launcher passes it, files with comments, and the errors for a missing or malformed one."""

import argparse
import base64
import json

import pytest
from config_helpers import config_error

from deepspeed_cpp.runtime.config import DeepSpeedConfig, DeepSpeedConfigError


def test_args_deepspeed_config_path_and_dict_beside_none(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 3}))
    from_args = DeepSpeedConfig.load(args=argparse.Namespace(deepspeed_config=str(path)))
    assert from_args.train_batch_size == 3 and from_args.source == str(path)
    beside = DeepSpeedConfig.load(
        config={"train_batch_size": 6}, args=argparse.Namespace(deepspeed_config=None), world_size=3
    )
    assert beside.train_micro_batch_size_per_gpu == 2
    assert DeepSpeedConfig.load(config=path).train_batch_size == 3


def test_config_given_twice_or_not_at_all():
    with pytest.raises(DeepSpeedConfigError, match="the config is given twice"):
        DeepSpeedConfig.load(
            config={"train_batch_size": 2}, args=argparse.Namespace(deepspeed_config="x.json")
        )
    with pytest.raises(DeepSpeedConfigError, match="no config given"):
        DeepSpeedConfig.load(args=argparse.Namespace(deepspeed_config=None))


def test_deprecated_deepscale_config_argument(tmp_path, ds_log):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 2}))
    config = DeepSpeedConfig.load(args=argparse.Namespace(deepscale_config=str(path)))
    assert config.train_batch_size == 2
    assert any("deepscale_config is deprecated" in r.getMessage() for r in ds_log.records)


def test_base64_config_as_deepspeeds_launcher_passes_it():
    encoded = base64.urlsafe_b64encode(json.dumps({"train_batch_size": 4}).encode()).decode()
    assert DeepSpeedConfig.load(encoded, world_size=2).train_micro_batch_size_per_gpu == 2


def test_comments_and_trailing_commas_are_accepted_with_a_warning(tmp_path, ds_log):
    path = tmp_path / "commented.json"
    path.write_text(
        '{\n  // batch\n  "train_batch_size": 4, # per step\n'
        '  "fp16": {"enabled": false, /* off */},\n}\n'
    )
    config = DeepSpeedConfig.load(path)
    assert config.train_batch_size == 4 and config.fp16.enabled is False
    assert any("comments or trailing commas" in r.getMessage() for r in ds_log.records)


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"train_batch_size": 4, "train_batch_size": 8}', "duplicate keys ['train_batch_size']"),
        ('{"train_batch_size": 4,\n "fp16": {"enabled": tru}}', "not valid JSON"),
        ("[1, 2]", "the top level is list: expected a JSON object"),
    ],
)
def test_bad_files(tmp_path, text, expected):
    path = tmp_path / "bad.json"
    path.write_text(text)
    message = config_error(path)
    assert expected in message and str(path) in message


def test_missing_file_and_bad_config_type():
    assert "no such file" in config_error("/nonexistent/ds_config.json")
    assert "expected the path of a JSON file, a dict" in config_error(42)


def test_raw_is_a_private_copy_of_what_was_given():
    given = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.1}}}
    config = DeepSpeedConfig.parse(given)
    given["optimizer"]["params"]["lr"] = 0.5
    assert config.raw["optimizer"]["params"]["lr"] == 0.1
    config.raw["optimizer"]["params"]["lr"] = 0.7
    assert config.raw["optimizer"]["params"]["lr"] == 0.1
    assert config.optimizer.params["lr"] == 0.1
    assert config.finalize(2).raw == config.raw
