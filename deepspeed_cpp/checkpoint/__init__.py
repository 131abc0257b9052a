"""``deepspeed.checkpoint``'s public helpers under the same path (``utils``).

The engine's own checkpoint code lives in ``deepspeed_cpp.runtime.checkpoint``.
"""

# The client_state key under which Megatron-style scripts store universal-checkpoint hints.
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
