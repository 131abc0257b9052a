"""What a save that did not finish leaves in ``save_dir``, and how the next save clears it.

A save that fails is cleaned up by the saver itself (its ``<tag>.partial`` is removed before the
save lock is released). A save that was killed cannot clean up, so the next save into the same
folder does it, holding the save lock (no other training can be mid-save there):

- ``<tag>.partial``: the staging directory of a save that never published; removed (only when it
  holds nothing but the files a save writes).
- ``<tag>.replaced`` (holding checkpoint metadata): the previous checkpoint of a tag that was
  being saved again. When the
  re-save got as far as publishing, ``<tag>`` is complete and the old copy is removed; when it
  stopped between its two renames, ``<tag>`` is absent and the old copy is renamed back, so a
  complete checkpoint is never deleted.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from ...utils.logging import logger
from .atomic_files import fsync_directory, remove_tree
from .layout import (
    CLIENT_STATE_FILE,
    DISPLACED_SUFFIX,
    METADATA_FILE,
    STAGING_SUFFIX,
)


def create_staging(save_dir: Path, staging: Path, lock) -> None:
    """Rank 0 of a save (the ZeRO saver's and the pipeline's): takes the folder's save ``lock``,
    clears what killed saves left, then creates ``staging``. A ``<tag>.partial`` still there
    holds files no save writes: it is refused, naming them, and left untouched."""
    save_dir.mkdir(parents=True, exist_ok=True)
    lock.acquire()  # before touching any <tag>.partial: it may be another training's save
    clear_interrupted_saves(save_dir)
    try:
        staging.mkdir()
    except FileExistsError:
        others = sorted(p.name for p in staging.iterdir() if not _SAVED_FILE.fullmatch(p.name))
        shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
        raise FileExistsError(
            f"{staging} exists and holds what no save writes ({shown or 'non-file entries'}); "
            "it was left as it is: move it away, or save under another tag"
        ) from None
    fsync_directory(save_dir)


def discard_staging(staging: Path) -> None:
    """Removes a failed save's staging directory (only when it holds nothing but what a save
    writes, as for a killed save's); a failure to do so is logged, not raised (the save's own
    error is the one to report, and the next save retries the removal)."""
    try:
        if staging.is_dir() and not _holds_only_checkpoint_files(staging):
            logger.warning(
                "deepspeed_cpp: %s holds files a save does not write; left as it is", staging
            )
            return
        remove_tree(staging)
    except OSError as error:
        logger.warning(
            "deepspeed_cpp: could not remove %s after the failed save (%s); the next save "
            "into %s removes it",
            staging,
            error.strerror or error,
            staging.parent,
        )


# What a save writes into its staging directory: the files below, each first under a temporary
# name (``.<name>.tmp-<pid>``, see atomic_files.py). Its module states (``mp_rank_00_...``, and a
# pipeline's per stage), shards (``zero_pp_rank_<r>_mp_rank_<s>_...``), a MoE model's expert
# files (expert_files.py), a pipeline's layer files (pipe/checkpoint.py), client state, metadata.
_SAVED_FILE = re.compile(
    r"\.?(zero_pp_rank_\d+_mp_rank_\d+_optim_states\.pt|(layer_\d+_expert_\d+_)?"
    r"mp_rank_\d+_model_states\.pt|layer_\d+-model_states\.pt|"
    rf"{re.escape(CLIENT_STATE_FILE)}|{re.escape(METADATA_FILE)})(\.tmp-\d+)?"
)


def _holds_only_checkpoint_files(directory: Path) -> bool:
    """Whether ``directory`` holds nothing but files a save writes: a folder that merely ends in
    the staging suffix, holding someone's other data, is never removed."""
    return all(p.is_file() and _SAVED_FILE.fullmatch(p.name) for p in directory.iterdir())


def clear_interrupted_saves(save_dir: Path) -> list[str]:
    """Clears what killed saves left in ``save_dir`` (see the module docstring); the caller
    holds the folder's save lock. Returns one line per entry it removed or restored."""
    done = []
    for entry in sorted(save_dir.iterdir()):
        if not entry.is_dir():
            continue
        if entry.name.endswith(STAGING_SUFFIX):
            if not _holds_only_checkpoint_files(entry):
                logger.warning(
                    "deepspeed_cpp: %s holds files a save does not write; left as it is", entry
                )
                continue
            remove_tree(entry)
            done.append(f"removed {entry} (a save that did not finish)")
        elif entry.name.endswith(DISPLACED_SUFFIX) and (entry / METADATA_FILE).is_file():
            final = entry.with_name(entry.name[: -len(DISPLACED_SUFFIX)])
            if (final / METADATA_FILE).is_file():
                try:
                    remove_tree(entry)
                except OSError as error:
                    # A stale copy that cannot go must not stop this save (another tag).
                    logger.warning(
                        "deepspeed_cpp: could not remove %s, the previous copy of the complete "
                        "%s (%s); left as it is",
                        entry,
                        final.name,
                        error.strerror or error,
                    )
                    continue
                done.append(f"removed {entry} (replaced by the complete {final.name})")
            elif not final.exists():
                os.replace(entry, final)
                done.append(f"renamed {entry} back to {final} (its re-save did not finish)")
            # else: something other than a checkpoint holds the name; leave both alone
    if done:
        with contextlib.suppress(OSError):
            fsync_directory(save_dir)
        logger.warning("deepspeed_cpp: cleared interrupted saves: %s", "; ".join(done))
    return done
