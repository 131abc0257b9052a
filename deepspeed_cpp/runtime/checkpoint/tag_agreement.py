"""One tag for the whole world's checkpoint, with DeepSpeed's ``checkpoint.tag_validation``.

DeepSpeed lets each rank save its files under the tag it was given, and compares the tags first:
``"FAIL"`` raises an ``AssertionError`` when they differ, ``"WARN"`` (its default) logs a warning
and saves, ``"IGNORE"`` saves without comparing. A deepspeed_cpp checkpoint is one folder that
all ranks publish together, so it cannot be split over several tags: where the ranks differ and
the mode lets the save go on, the whole checkpoint is saved under rank 0's tag, the one that
DeepSpeed's ``latest`` file (written by rank 0) names, and a warning says so in both modes.

The ranks compare a digest of their tags, gathered as a tensor: no rank unpickles what another
sent. Only where the digests differ are the tags themselves gathered, as UTF-8 bytes, for the
message and rank 0's tag.
"""

from __future__ import annotations

from ...comm.text_agreement import all_gather_text, same_on_every_rank
from ...utils.logging import logger

MODES = ("IGNORE", "WARN", "FAIL")


class CheckpointTagMismatchError(ValueError, AssertionError):
    """The ranks passed different tags to ``save_checkpoint`` under ``tag_validation: "FAIL"``.
    An ``AssertionError`` as DeepSpeed raises, and a ``ValueError`` (a wrong argument)."""


def agree_on_tag(tag: str, mode: str = "WARN") -> str:
    """The tag every rank saves under (collective over the whole world): ``tag`` where all ranks
    gave the same one, else rank 0's, or ``CheckpointTagMismatchError`` on every rank with
    ``mode`` "FAIL"."""
    if mode not in MODES:
        raise ValueError(f"checkpoint.tag_validation = {mode!r}: expected one of {list(MODES)}")
    digests = "all_gather of the tag's digest at the start of save_checkpoint"
    if same_on_every_rank(tag.encode("utf-8"), digests):
        return tag
    tags = all_gather_text(tag, "of the tags in save_checkpoint")
    differ = f"save_checkpoint: the ranks gave different tags {tags}"
    if mode == "FAIL":
        raise CheckpointTagMismatchError(
            f"{differ}; every rank must save the same tag (checkpoint.tag_validation is "
            f'"FAIL"; "WARN" or "IGNORE" would save under rank 0\'s tag)'
        )
    # Under "IGNORE" DeepSpeed says nothing, but there each rank's files would go under its own
    # tag; here they go elsewhere, so both modes say where.
    logger.warning(
        "%s; the checkpoint is saved whole under rank 0's tag %r (checkpoint.tag_validation "
        'is "%s"; a rank-dependent tag cannot be loaded back at another world size)',
        differ,
        tags[0],
        mode,
    )
    return tags[0]
