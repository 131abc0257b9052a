"""Where the aio and swap-file tests put files: a real disk file system, so that O_DIRECT is
exercised (tmpfs only emulates it)."""

from __future__ import annotations

import os


def fs_type(path) -> str:
    """The file system type of the mount holding `path` (the longest matching mount point)."""
    path, best, kind = os.path.realpath(path), "", "unknown"
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            _, mount_point, fs_type = line.split()[:3]
            inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
            if inside and len(mount_point) >= len(best):
                best, kind = mount_point, fs_type
    return kind


def o_direct_works(folder) -> bool:
    probe = os.path.join(folder, ".o_direct_probe")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def on_a_real_disk(folder) -> bool:
    """Whether files in `folder` take the O_DIRECT path for real."""
    return fs_type(folder) not in ("tmpfs", "ramfs") and o_direct_works(folder)
