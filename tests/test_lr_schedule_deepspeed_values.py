"""deepspeed_cpp's lr schedules against DeepSpeed 0.19.8's own numbers: every case of
tests/lr_schedule_cases.py (the parameter grids of DeepSpeed's test_lr_schedulers.py and edge
cases: unknown warmup types, a zero second OneCycle half, per-group lists, several groups,
explicit step positions, SGD) run on our classes, step by step, against
tests/fixtures/lr_schedules/deepspeed_values.json (written by make_fixture.py with real
DeepSpeed): the lrs written and returned, the betas OneCycle writes, get_mom()."""

import json
import logging
import math
from pathlib import Path

import pytest
from lr_schedule_cases import CASES, run_case

from deepspeed_cpp.runtime import lr_schedules

FIXTURE = Path(__file__).parent / "fixtures" / "lr_schedules" / "deepspeed_values.json"
EXPECTED = json.loads(FIXTURE.read_text())


def test_fixture_is_deepspeeds_and_covers_every_case():
    assert EXPECTED["deepspeed_version"] == "0.19.8"
    assert set(EXPECTED["cases"]) == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_schedule_matches_deepspeed(name):
    expected = EXPECTED["cases"][name]
    ours = run_case(lr_schedules, CASES[name])
    assert ours["error"] == expected["error"]
    assert len(ours["trace"]) == len(expected["trace"])
    for step, (mine, theirs) in enumerate(zip(ours["trace"], expected["trace"])):
        assert mine.keys() == theirs.keys(), step
        for key, values in theirs.items():
            assert len(mine[key]) == len(values), (step, key)
            for a, b in zip(mine[key], values):
                assert math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15), (step, key, a, b)


def test_unknown_warmup_type_warns_naming_it(caplog):
    deepspeed_logger = logging.getLogger("deepspeed_cpp")
    deepspeed_logger.addHandler(caplog.handler)
    try:
        run_case(lr_schedules, CASES["warmup_cosine_unknown_type"])
    finally:
        deepspeed_logger.removeHandler(caplog.handler)
    assert "warmup_type='cubic' is not one of ('log', 'linear'); using 'log'" in caplog.text


def test_one_cycle_step_ratio():
    import torch

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    schedule = lr_schedules.OneCycle
    assert (
        schedule(
            optimizer, 0.01, 0.1, cycle_first_step_size=100, cycle_second_step_size=0
        ).step_ratio
        == 1.0
    )
    assert (
        schedule(optimizer, 0.01, 0.1, cycle_first_step_size=3, cycle_second_step_size=5).step_ratio
        == 3 / 8
    )
