"""A moment at exit for torch.distributed's worker threads to finish with Python tensors.

A gloo worker thread runs each collective and then drops its own reference to the collective's
``Work``; when that reference is the last one (the caller's ``wait()`` has returned and its
``Work`` is gone), the ``Work``'s tensors are released on the worker thread, and releasing a
tensor that has a Python object needs the GIL. The worker asks for the GIL and waits until the
main thread lets it go, which the interpreter grants only every ``sys.getswitchinterval()``
(5 ms). A script that ends right after its last collective (``engine.step()``,
``dist.destroy_process_group()``, end of file) can reach interpreter finalization first; Python
then ends the waiting thread with ``pthread_exit``, whose forced unwind through the ``Work``'s
``noexcept`` destructor calls ``std::terminate``: "terminate called without an active
exception", SIGABRT, exit code -6 after a run that finished its work (seen with gdb: a
``pt_gloo_runloop`` thread in ``~AsyncBroadcastWork`` -> ``TensorImpl::decref_pyobject`` ->
``take_gil`` -> ``PyThread_exit_thread``). 4 of 30 two-rank ZeRO-2 runs here ended so.

The cure is to let go of the GIL for a moment at exit, while the interpreter is still whole: the
waiting threads take it, release their tensors and go back to sleep. ``atexit`` handlers run
before finalization, so one handler that sleeps (which releases the GIL) is enough.
"""

from __future__ import annotations

import atexit
import time

# Long enough for a worker thread that waits for the GIL to be scheduled and take it on a loaded
# machine (the interpreter's switch interval is 5 ms), short enough not to be felt at exit.
EXIT_GRACE_SECONDS = 0.02

_registered = False


def release_gil_at_exit() -> None:
    """Registers (once per process) an exit handler that releases the GIL for
    ``EXIT_GRACE_SECONDS`` so that collective worker threads can finish releasing tensors."""
    global _registered
    if not _registered:
        atexit.register(time.sleep, EXIT_GRACE_SECONDS)
        _registered = True
