"""``deepspeed.checkpoint``'s public helpers under the same path (``utils``).

The engine's own checkpoint code lives in ``deepspeed_cpp.runtime.checkpoint``.
"""
