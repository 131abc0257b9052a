"""Configs DeepSpeed 0.19.8 accepts, read with DeepSpeed's meaning (issue 26), and config errors
that cross process boundaries whole.

DeepSpeed's own test harness runs each test in a multiprocessing pool and re-raises the worker's
exception in the parent; so do users' launchers. An error rebuilt there from its message alone
used to become one "problem" per letter ("Invalid DeepSpeed config, 177 problems: I, n, v, ...").
"""

import multiprocessing
import pickle

import pytest

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
