"""Peak host memory of a block of code in this process, from Linux's /proc/self.

``VmHWM`` (the peak resident set) is reset on entry (``/proc/self/clear_refs``) and read on exit;
a sampling thread also follows the anonymous part (resident minus file-backed and shared pages),
because a checkpoint read through a memory map counts in the resident set while the kernel can
drop it at will. Figures are in MiB, above the resident set at entry.
"""

from __future__ import annotations

import threading
import time

MIB = 1 << 20


def _status() -> dict[str, int]:
    """/proc/self/status's memory lines, in bytes."""
    values = {}
    with open("/proc/self/status") as handle:
        for line in handle:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                values[key] = int(rest.split()[0]) * 1024
    return values


def _anon_bytes() -> int:
    with open("/proc/self/statm") as handle:
        _, resident, shared, *_ = (int(x) for x in handle.read().split())
    import resource

    return (resident - shared) * resource.getpagesize()


class PeakMemory:
    def __init__(self, interval_s: float = 0.001):
        self.interval_s = interval_s
        self._stop = threading.Event()
        self.peak_anon = 0

    def __enter__(self):
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")  # resets VmHWM to the current resident set
            self.hwm_reset = True
        except OSError:
            self.hwm_reset = False
        self.start = _status()
        self.start_anon = _anon_bytes()
        self.peak_anon = self.start_anon
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_anon = max(self.peak_anon, _anon_bytes())
            time.sleep(self.interval_s)

    def __exit__(self, *exc_info):
        self._stop.set()
        self._thread.join()
        self.peak_anon = max(self.peak_anon, _anon_bytes())
        self.end = _status()
        return False

    def report(self) -> dict:
        """MiB above the entry's resident set: peak resident (``None`` when VmHWM could not be
        reset), peak anonymous (sampled), and the file-backed pages still mapped at exit."""
        peak_rss = (self.end["VmHWM"] - self.start["VmRSS"]) / MIB if self.hwm_reset else None
        return {
            "baseline_rss_mib": self.start["VmRSS"] / MIB,
            "peak_rss_mib": peak_rss,
            "peak_anon_mib": (self.peak_anon - self.start_anon) / MIB,
            "end_file_mib": (self.end["RssFile"] - self.start["RssFile"]) / MIB,
        }
