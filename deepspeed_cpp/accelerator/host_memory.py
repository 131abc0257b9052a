"""Host memory figures for the CPU accelerator, read from the kernel (Linux ``/proc``).

On the CPU the "device memory in use" that training scripts log is the process's resident set
(RSS), as DeepSpeed's CPU accelerator reports it. The peak is tracked in Python from the
samples taken through these calls (``reset`` starts a new one), because the kernel's own peak
(``VmHWM``/``ru_maxrss``) can only be reset for the whole process by writing to
``/proc/self/clear_refs``, which would also disturb other tools.
"""

from __future__ import annotations

import os
import resource


def resident_bytes() -> int:
    """The process's resident set size in bytes."""
    try:
        with open("/proc/self/statm") as statm:
            resident_pages = int(statm.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        # No /proc (macOS): the lifetime peak is the best figure available.
        return peak_resident_bytes_since_start()


def peak_resident_bytes_since_start() -> int:
    """The kernel's lifetime peak RSS of this process, in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes, macOS bytes.
    return peak if os.uname().sysname == "Darwin" else peak * 1024


def total_bytes() -> int:
    """Physical memory of the machine in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_bytes() -> int:
    """Memory that can be allocated without swapping (``MemAvailable``), in bytes."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class ResidentPeak:
    """The highest RSS seen by ``sample()`` since creation or the last ``reset()``."""

    def __init__(self) -> None:
        self.peak = resident_bytes()

    def sample(self) -> int:
        """Read the RSS now, fold it into the peak and return it."""
        current = resident_bytes()
        self.peak = max(self.peak, current)
        return current

    def reset(self) -> int:
        """Start a new peak at the current RSS and return it."""
        self.peak = resident_bytes()
        return self.peak
