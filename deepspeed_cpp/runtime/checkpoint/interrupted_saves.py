"""What a save that did not finish leaves in ``save_dir``, and how the next save clears it.

A save that fails is cleaned up by the saver itself (its ``<tag>.partial`` is removed before the
save lock is released). A save that was killed cannot clean up, so the next save into the same
folder does it, holding the save lock (no other training can be mid-save there):

- ``<tag>.partial``: the staging directory of a save that never published; removed.
- ``<tag>.replaced``: the previous checkpoint of a tag that was being saved again. When the
  re-save got as far as publishing, ``<tag>`` is complete and the old copy is removed; when it
  stopped between its two renames, ``<tag>`` is absent and the old copy is renamed back, so a
  complete checkpoint is never deleted.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ...utils.logging import logger
from .atomic_files import fsync_directory, remove_tree
from .layout import DISPLACED_SUFFIX, METADATA_FILE, STAGING_SUFFIX


def discard_staging(staging: Path) -> None:
    """Removes a failed save's staging directory; a failure to do so is logged, not raised (the
    save's own error is the one to report, and the next save retries the removal)."""
    try:
        remove_tree(staging)
    except OSError as error:
        logger.warning(
            "deepspeed_cpp: could not remove %s after the failed save (%s); the next save "
            "into %s removes it",
            staging,
            error.strerror or error,
            staging.parent,
        )


def clear_interrupted_saves(save_dir: Path) -> list[str]:
    """Clears what killed saves left in ``save_dir`` (see the module docstring); the caller
    holds the folder's save lock. Returns one line per entry it removed or restored."""
    done = []
    for entry in sorted(save_dir.iterdir()):
        if not entry.is_dir():
            continue
        if entry.name.endswith(STAGING_SUFFIX):
            remove_tree(entry)
            done.append(f"removed {entry} (a save that did not finish)")
        elif entry.name.endswith(DISPLACED_SUFFIX):
            final = entry.with_name(entry.name[: -len(DISPLACED_SUFFIX)])
            if (final / METADATA_FILE).is_file():
                remove_tree(entry)
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
