"""Where the aio and swap-file tests put files: a real disk file system, so that O_DIRECT is
exercised (tmpfs only emulates it), or a small file system of their own in a mount namespace."""

from __future__ import annotations

import os
import shutil
import subprocess


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


_NAMESPACE_PROBE = "mount -t tmpfs -o size=64k tmpfs {0} && umount {0}"


def mount_namespace_prefix(tmp_path):
    """A command prefix running its command in a private mount namespace, or None when this
    machine does not allow one (no unshare, or no privileges and no user namespaces)."""
    if shutil.which("unshare") is None:
        return None
    probe_dir = tmp_path / "probe_mount"
    probe_dir.mkdir()
    variants = [["unshare", "--mount", "--propagation", "private"]]
    variants.append(["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"])
    for prefix in variants if os.geteuid() == 0 else variants[1:]:
        probe = [*prefix, "sh", "-c", _NAMESPACE_PROBE.format(probe_dir)]
        if subprocess.run(probe, capture_output=True).returncode == 0:
            return prefix
    return None
