"""Configs DeepSpeed 0.19.8 accepts, read with DeepSpeed's meaning (issue 26), and config errors
that cross process boundaries whole.

DeepSpeed's own test harness runs each test in a multiprocessing pool and re-raises the worker's
exception in the parent; so do users' launchers. An error rebuilt there from its message alone
used to become one "problem" per letter ("Invalid DeepSpeed config, 177 problems: I, n, v, ...").
"""

import json
import multiprocessing
import pickle

import pytest
import torch

from deepspeed_cpp.integrations.hf.config_filling import ConfigMismatchError
from deepspeed_cpp.runtime.config import DeepSpeedConfig, DeepSpeedConfigError


def _raise_config_error(config):
    DeepSpeedConfig.load(config)


def _bad_config():
    # Two real problems, so the count in the message is checked too.
    return {"train_batch_size": 0, "zero_optimization": {"stage": 9}}


def test_config_errors_pickle_whole():
    with pytest.raises(DeepSpeedConfigError) as caught:
        DeepSpeedConfig.load(_bad_config())
    error = caught.value
    assert len(error.problems) == 2, error.problems
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is DeepSpeedConfigError
    assert copy.problems == error.problems and copy.source == error.source
    assert str(copy) == str(error)

    mismatch = ConfigMismatchError(["train_batch_size: config 8, arguments 16"])
    copy = pickle.loads(pickle.dumps(mismatch))
    assert copy.mismatches == mismatch.mismatches and str(copy) == str(mismatch)


def test_config_error_raised_in_a_worker_process_arrives_whole():
    with pytest.raises(DeepSpeedConfigError) as caught:
        DeepSpeedConfig.load(_bad_config())
    expected = caught.value.problems
    # fork: no interpreter start-up; the worker raises, the pool pickles the error back.
    with multiprocessing.get_context("fork").Pool(1) as pool:
        with pytest.raises(DeepSpeedConfigError) as caught:
            pool.apply(_raise_config_error, (_bad_config(),))
    assert caught.value.problems == expected
    assert "2 problems" in str(caught.value)


def _said(caplog, text):
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def _config(stage, precision, accum):
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}}
    if precision != "fp32":
        config[precision] = {"enabled": True}
    if accum != "unset":
        config["data_types"] = {"grad_accum_dtype": accum}
    return config


# DeepSpeed 0.19.8's verdicts (engine._do_optimizer_sanity_check, test_ds_initialize's table):
# with ZeRO every dtype is accepted; without it only the model's own dtype (or none).
@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("accum", ["unset", None, "fp16", "bf16", "fp32", "float32", "bfloat16"])
def test_grad_accum_dtype_accepted_where_deepspeed_accepts_it(ds_log, precision, accum):
    canonical = {"float32": "fp32", "bfloat16": "bf16"}.get(accum, accum)
    for stage in (1, 2, 3):
        DeepSpeedConfig.load(_config(stage, precision, accum))
    low_precision_other = canonical in ("fp16", "bf16") and canonical != precision
    # fp32 (and the model's own dtype) is what deepspeed_cpp's ZeRO stages do: no warning; a
    # low precision it cannot accumulate in is named once, with what happens instead.
    warned = _said(ds_log, "data_types.grad_accum_dtype")
    assert len(warned) == (1 if low_precision_other else 0), warned
    if warned:
        assert "accumulated in fp32" in warned[0] and f"accumulate in {canonical}" in warned[0]
    mixes = canonical not in ("unset", None, precision)
    if not mixes:
        DeepSpeedConfig.load(_config(0, precision, accum))
        return
    with pytest.raises(NotImplementedError) as caught:
        DeepSpeedConfig.load(_config(0, precision, accum))
    assert isinstance(caught.value, DeepSpeedConfigError)
    message = str(caught.value)
    assert f"data_types.grad_accum_dtype = {json.dumps(accum)}" in message, message
    assert f"model dtype {precision} and grad_accum_dtype {canonical}" in message, message


def test_grad_accum_dtype_bad_value_is_named():
    with pytest.raises(DeepSpeedConfigError) as caught:
        DeepSpeedConfig.load(_config(2, "bf16", "int8"))
    assert 'data_types.grad_accum_dtype = "int8": expected null or one of "fp16"' in str(
        caught.value
    )


def test_bf16_check_grad_overflow(ds_log):
    # True, DeepSpeed 0.19.8's default, is what deepspeed_cpp does: silent.
    config = DeepSpeedConfig.load(
        {
            "train_micro_batch_size_per_gpu": 1,
            "bf16": {"enabled": True, "check_grad_overflow": True},
        }
    )
    assert config.bf16.check_grad_overflow is True
    assert not _said(ds_log, "check_grad_overflow")
    # False would let DeepSpeed apply a non-finite step; deepspeed_cpp still skips it, and says so.
    DeepSpeedConfig.load(
        {
            "train_micro_batch_size_per_gpu": 1,
            "bf16": {"enabled": True, "check_grad_overflow": False},
        }
    )
    (warned,) = _said(ds_log, "check_grad_overflow")
    assert "'bf16.check_grad_overflow': false has no effect" in warned
    assert "always skipped" in warned and "it behaves as true" in warned
    with pytest.raises(DeepSpeedConfigError) as caught:
        DeepSpeedConfig.load(
            {"train_micro_batch_size_per_gpu": 1, "bf16": {"check_grad_overflow": "yes"}}
        )
    assert "bf16.check_grad_overflow" in str(caught.value)


class _PartlyUsed(torch.nn.Module):
    """``unused`` is trainable but never takes part in the loss."""

    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(4, 4)
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x, use_all=False):
        out = self.used(x)
        return (out + self.unused(x) if use_all else out).pow(2).mean()


def _unused_parameters_job():
    import torch.distributed as dist

    import deepspeed_cpp

    def engine(ignore, offload, gas=1):
        torch.manual_seed(0)
        zero = {"stage": 2, "ignore_unused_parameters": ignore}
        if offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": gas,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "zero_optimization": zero,
        }
        model = _PartlyUsed()
        return deepspeed_cpp.initialize(model=model, config=config)[0]

    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    outcome = {}
    # DeepSpeed's check: ZeRO 1/2 offloaded to the host, at the step, naming the key.
    refused = engine(False, True)
    refused.backward(refused(x))
    try:
        refused.step()
    except AssertionError as error:
        outcome["refused"] = str(error)
    # Every parameter used (over 2 micro-steps): the same config steps, every window afresh.
    used = engine(False, True, gas=2)
    before = used.module.unused.weight.detach().clone()
    for _ in range(4):
        used.backward(used(x, use_all=True))
        used.step()
    outcome["used_steps"] = used.global_steps
    outcome["unused_moved"] = not torch.equal(before, used.module.unused.weight.detach())
    used.destroy()
    # The default (true), and false without offload (DeepSpeed does not check there): a zero
    # gradient for the unused parameter, which Adam leaves where it was.
    for ignore, offload in ((True, True), (False, False)):
        quiet = engine(ignore, offload)
        before = quiet.module.unused.weight.detach().clone()
        quiet.backward(quiet(x))
        quiet.step()
        outcome[f"quiet_{ignore}_{offload}"] = (
            quiet.global_steps,
            torch.equal(before, quiet.module.unused.weight.detach()),
        )
        quiet.destroy()
    return outcome


def test_ignore_unused_parameters_false_asserts_where_deepspeed_does(pool2):
    for outcome in pool2.run(_unused_parameters_job):
        refused = outcome.get("refused")
        assert refused is not None, "an unused parameter went through with the check on"
        assert "2 of 4 trainable parameters got no gradient" in refused, refused
        assert "(4, 4)" in refused and "(4,)" in refused, refused
        assert "ignore_unused_parameters" in refused, refused
        assert outcome["used_steps"] == 2 and outcome["unused_moved"]
        assert outcome["quiet_True_True"] == (1, True)
        assert outcome["quiet_False_False"] == (1, True)


def test_configure_train_batch_size_resolves_in_place_and_asserts_like_deepspeed():
    """DeepSpeed's ``DeepSpeedConfig._configure_train_batch_size()`` after a script set the three
    batch fields by hand (None: derive it): any two give the third, one of train/micro gives
    accumulation 1, for the world size the config was finalised for; contradictions and
    underivable values raise an AssertionError (DeepSpeed asserts) naming the values."""
    from deepspeed_cpp.runtime.config.errors import BatchSizeError

    world = int(torch.randint(2, 5, ()))
    micro, accumulation = (int(v) for v in torch.randint(1, 9, (2,)))
    train = micro * accumulation * world
    config = DeepSpeedConfig.load({"train_batch_size": world}, world_size=world)
    given_sets = [
        (train, micro, accumulation),
        (train, micro, None),
        (train, None, accumulation),
        (None, micro, accumulation),
    ]
    for given in given_sets:
        config.train_batch_size, config.train_micro_batch_size_per_gpu = given[:2]
        config.gradient_accumulation_steps = given[2]
        config._configure_train_batch_size()
        resolved = (
            config.train_batch_size,
            config.train_micro_batch_size_per_gpu,
            config.gradient_accumulation_steps,
        )
        assert resolved == (train, micro, accumulation), given
    for given, expected in (
        ((None, micro, None), micro * world),
        ((micro * world, None, None), micro * world),
    ):
        config.train_batch_size, config.train_micro_batch_size_per_gpu = given[:2]
        config.gradient_accumulation_steps = given[2]
        config._configure_train_batch_size()
        assert (config.train_batch_size, config.gradient_accumulation_steps) == (expected, 1)
    # DeepSpeed's failing rows (its TestBatchConfig): contradicting, underivable, gas alone.
    bad = [
        (train + 1, micro, accumulation),
        (micro * world + 1, micro, None),
        (None, None, accumulation),
    ]
    for given in bad:
        config.train_batch_size, config.train_micro_batch_size_per_gpu = given[:2]
        config.gradient_accumulation_steps = given[2]
        with pytest.raises(AssertionError) as raised:
            config._configure_train_batch_size()
        assert isinstance(raised.value, BatchSizeError), given
        assert "train_batch_size" in str(raised.value), given
