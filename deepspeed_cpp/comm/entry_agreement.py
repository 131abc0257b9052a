"""Makes every rank agree on a description of what it is about to do, before it does it.

A rank whose tensors differ from its peers' (another shape, another dtype, another order) makes
the next collective abort the process inside gloo ("Received data size doesn't match expected
size", SIGABRT) or wait on a key nobody writes. So where ranks must hold the same things, each
describes them as ordered ``(key, value)`` text entries, and ``agree_on_entries`` all-gathers a
32-byte digest of the entries: one collective of the same size and dtype on every rank, so it
cannot mismatch itself. Only when the digests differ are the entries all-gathered, and every rank
raises the same ``RankDisagreementError`` naming the differing keys and each rank's value.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
import torch.distributed as dist

from .text_agreement import all_gather_text, same_on_every_rank

FAILED = "set-up failed"  # the key of a rank that could not describe itself (see below)
_REACHED = "reached"  # the first entry: where the rank is; two agreements must not pair up
_PLAIN_LINES_SHOWN = 10  # differing plain keys named in one error
_ITEM_PREFIXES = ("parameter #", "buffer #")  # entries of a sequence: one change shifts many


class RankDisagreementError(RuntimeError):
    """Ranks set up different things where they must be the same (config, model, optimizer);
    the message names each differing key or the first differing parameter, with every rank's
    value."""


def agree_on_entries(
    entries: list[tuple[str, object]],
    *,
    what: str,
    advice: str,
    readable: Callable[[list], list[tuple[str, str]]] | None = None,
    device: torch.device | None = None,
    group=None,
) -> None:
    """Returns when every rank of ``group`` passed the same ``entries``; else raises
    ``RankDisagreementError`` on every rank. Collective. Values are text or JSON-able plain
    data; ``readable(entries)`` (only called on a mismatch) gives them as text, and a
    parameter's text starts with its quoted name. ``what`` names the moment ("at
    deepspeed_cpp.initialize()"), ``advice`` what must hold. ``device`` holds the digest where
    the backend takes no host tensors (NCCL); gloo's digest stays on the host.

    A rank that failed before it could describe itself passes ``[(FAILED, its error)]``: the
    others then name it and its error instead of waiting for it in a later collective."""
    if dist.get_world_size(group) == 1:
        return
    # Every agreement is the same all-gather: a rank at another agreement point (zero.Init on
    # one rank, initialize() on the other) pairs with it, and must be told apart.
    entries = [(_REACHED, what), *entries]
    digests = f"all_gather of the set-up digests {what} (rank agreement)"
    if same_on_every_rank(json.dumps(entries).encode(), digests, group, device):
        return
    texts = [entries[0], *readable(entries[1:])] if readable is not None else entries
    gathered = all_gather_text(
        json.dumps(texts), f"of the set-up descriptions {what} (rank agreement)", group, device
    )
    descriptions = [_as_tuples(json.loads(text)) for text in gathered]
    raise RankDisagreementError(describe_disagreement(descriptions, what, advice))


def _as_tuples(value):
    """JSON's arrays back as tuples, as the entries were (values are compared and used as keys)."""
    if isinstance(value, list):
        return tuple(_as_tuples(item) for item in value)
    return value


def describe_disagreement(descriptions: list[list], what: str, advice: str) -> str:
    """The error text for every rank's entries (``descriptions[r]`` is rank r's)."""
    per_rank = [dict(entries) for entries in descriptions]
    header = f"ranks disagree {what}; {advice}:"
    failed = [(r, d[FAILED]) for r, d in enumerate(per_rank) if FAILED in d]
    if failed:
        return "\n".join([header, *(f"  rank {r} could not set up: {text}" for r, text in failed)])
    if len({d.get(_REACHED) for d in per_rank}) > 1:
        line = _difference_line(_REACHED, per_rank)
        return (
            f"ranks disagree on where they are ({what}); every rank must build the same model "
            f"and call the same set-up steps in the same order:\n{line}"
        )
    keys = list(dict.fromkeys(key for entries in descriptions for key, _ in entries))
    differing = [key for key in keys if len({d.get(key) for d in per_rank}) > 1]
    items = [key for key in differing if key.startswith(_ITEM_PREFIXES)]
    plain = [key for key in differing if not key.startswith(_ITEM_PREFIXES)]
    lines = [_difference_line(key, per_rank) for key in plain[:_PLAIN_LINES_SHOWN]]
    if len(plain) > _PLAIN_LINES_SHOWN:
        lines.append(f"  ... and {len(plain) - _PLAIN_LINES_SHOWN} more keys")
    if items:
        # One parameter added or changed shifts or changes many later entries: the first one
        # names it.
        lines.append(_difference_line(items[0], per_rank))
        if len(items) > 1:
            lines.append(f"  ... and {len(items) - 1} more parameter or buffer entries differ")
        lines += _order_note(descriptions)
    return "\n".join([header, *lines])


def _difference_line(key: str, per_rank: list[dict]) -> str:
    by_value: dict = {}
    for r, entries in enumerate(per_rank):
        by_value.setdefault(entries.get(key, "(none)"), []).append(r)
    values = "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {value}"
        for value, ranks in by_value.items()
    )
    return f"  {key}: {values}"


def _order_note(descriptions: list[list]) -> list[str]:
    """Says so when the ranks hold the same parameters registered in another order (a
    parameter entry's value starts with its quoted name)."""

    def names(entries):
        return [
            value.rsplit("' shape ", 1)[0][1:]
            for key, value in entries
            if key.startswith("parameter #")
        ]

    orders = [names(entries) for entries in descriptions]
    if any(order != orders[0] for order in orders) and all(
        sorted(order) == sorted(orders[0]) for order in orders
    ):
        return ["  (the same parameters, registered in a different order)"]
    return []
