"""Runs one step of a collective save or load on every rank and makes every rank agree on it.

A rank that fails (disk full, a missing file) must not leave the others waiting in the next
collective, nor let them publish a checkpoint without its part: each step's outcome is
all-gathered, and if any rank failed, every rank raises, naming the ranks and their errors.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TypeVar

from ...comm.text_agreement import all_gather_text

T = TypeVar("T")


def agree_on(
    action: Callable[[], T],
    *,
    group,
    what: str,
    error_type: type[Exception],
    keep_local_error: bool = False,
) -> list[T]:
    """Runs ``action()`` here and returns every rank's result, in rank order.

    If some rank raised, every rank raises ``error_type`` naming the failed ranks (a rank that
    failed itself re-raises its own exception unchanged when ``keep_local_error``). Results travel
    as JSON: a tuple comes back as a list.
    """
    local_error: Exception | None = None
    result = None
    try:
        result = action()
    except Exception as error:  # noqa: BLE001 - reported to every rank below
        local_error = error
    try:
        outcome = json.dumps(
            [
                local_error is None,
                result,
                None if local_error is None else f"{type(local_error).__name__}: {local_error}",
            ]
        )
    except (TypeError, ValueError) as error:  # a result JSON cannot hold: this rank's failure
        local_error = error
        outcome = json.dumps([False, None, f"{type(error).__name__}: {error}"])
    # JSON text over tensor collectives: nothing another rank sent is unpickled.
    gathered = all_gather_text(outcome, f"of every rank's outcome in {what}", group)
    outcomes = [json.loads(text) for text in gathered]
    failures = [(rank, text) for rank, (ok, _, text) in enumerate(outcomes) if not ok]
    if failures:
        if local_error is not None and keep_local_error:
            raise local_error
        details = "; ".join(f"rank {rank}: {text}" for rank, text in failures)
        raise error_type(f"{what} failed on {len(failures)} rank(s): {details}") from local_error
    return [value for _, value, _ in outcomes]
