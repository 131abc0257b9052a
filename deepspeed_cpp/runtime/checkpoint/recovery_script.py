"""``zero_to_fp32.py`` beside ``latest`` in every folder ``save_checkpoint`` writes into.

DeepSpeed copies its converter there, and the Hugging Face guide's recovery step is
``cd checkpoint-12; python zero_to_fp32.py . OUTPUT``. Ours is a thin script: the converter is
``deepspeed_cpp.utils.zero_to_fp32`` of whichever deepspeed_cpp the running Python imports, so a
checkpoint copied elsewhere is read by the installed package rather than by code frozen into the
folder at save time. It needs no alias (it imports ``deepspeed_cpp`` by its own name) and works
from any working directory (the checkpoint path is an argument).

The script is outside the tag folders, so it is in no checkpoint's file list or digests;
loading never reads it.
"""

from __future__ import annotations

import stat
from pathlib import Path

from .atomic_files import write_atomically_by_name

SCRIPT_NAME = "zero_to_fp32.py"

SCRIPT = '''\
#!/usr/bin/env python
"""Recovers the fp32 weights of the checkpoints in this folder (written by deepspeed_cpp's
save_checkpoint, as DeepSpeed writes its zero_to_fp32.py):

    python zero_to_fp32.py . OUTPUT_DIR [--safe_serialization] [--max_shard_size 5GB] [-t TAG]
    python zero_to_fp32.py . pytorch_model.bin        (one file)
    python zero_to_fp32.py -h

It runs deepspeed_cpp.utils.zero_to_fp32 of the installed deepspeed_cpp, whose functions it
also offers to code that imports this file.
"""

import sys

try:
    from deepspeed_cpp.utils.zero_to_fp32 import (  # noqa: F401 (offered to importers)
        convert_zero_checkpoint_to_fp32_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint,
        main,
    )
except ImportError as error:
    if __name__ != "__main__":
        raise
    sys.exit(
        f"zero_to_fp32.py: this Python ({sys.executable}) cannot import deepspeed_cpp "
        f"({error}); install deepspeed_cpp (pip install deepspeed_cpp) to read this checkpoint"
    )

if __name__ == "__main__":
    sys.exit(main(prog="zero_to_fp32.py"))
'''


def write_recovery_script(save_dir: Path) -> bool:
    """Writes ``save_dir/zero_to_fp32.py`` (executable, atomically) unless it already holds
    exactly this script; returns whether it wrote. Skipping an unchanged script keeps a save's
    disk writes to the checkpoint itself."""
    path = Path(save_dir) / SCRIPT_NAME
    data = SCRIPT.encode("utf-8")
    try:
        if path.is_file() and not path.is_symlink() and path.read_bytes() == data:
            return False
    except OSError:
        pass  # unreadable: replaced below, or the write says why not

    def write(temporary: Path) -> None:
        temporary.write_bytes(data)
        mode = stat.S_IMODE(temporary.stat().st_mode)
        temporary.chmod(mode | (mode & 0o444) >> 2)  # executable by whoever may read it

    write_atomically_by_name(path, write)
    return True
