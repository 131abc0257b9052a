"""DeepSpeed's ``deepspeed.runtime.activation_checkpointing``: ``checkpointing`` (public as
``deepspeed.checkpointing``) and the RNG tracker it restores."""
