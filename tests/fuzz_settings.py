"""Hypothesis settings shared by the op fuzzing tests.

CI runs the "ci" profile: derandomized (the same examples every run, so a failure reproduces),
no example database, DS_OP_FUZZ_EXAMPLES examples per property (60 unless set). By hand, pick
a longer, random search with ``HYPOTHESIS_PROFILE=thorough`` (2,000 examples, new ones each
run; hypothesis prints the failing example and how to reproduce it).
"""

from __future__ import annotations

import os

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, settings  # noqa: E402

EXAMPLES = int(os.environ.get("DS_OP_FUZZ_EXAMPLES", "60"))
settings.register_profile(
    "ci",
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
settings.register_profile(
    "thorough",
    max_examples=2000,
    deadline=None,
    derandomize=False,
    database=None,
    suppress_health_check=list(HealthCheck),
)
FUZZ = settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
