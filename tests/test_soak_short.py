"""The soak's short form (benchmarks/soak.py): 2 gloo ranks, random SIGKILLs of either rank,
restarts from ``latest``; the final fp32 parameters equal an uninterrupted run's exactly."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from soak import soak  # noqa: E402


def test_soak_short_form_loses_nothing():
    result = soak(steps=20, save_every=5, kill_every=10, seed=0, task="mlp")
    assert result["kills survived"] >= 1, result
    assert result["resumes"] == result["kills survived"], result
    assert result["max |diff|"] == 0, result
