"""``deepspeed.checkpointing``: the very module ``deepspeed_cpp.runtime.activation_checkpointing
.checkpointing``, importable under this shorter name too.

The module keeps its configuration in module attributes that scripts read and set
(``deepspeed.checkpointing.PARTITION_ACTIVATIONS``), so both names must be one module object,
not a copy of its names: importing this file puts that module in its own place.
"""

import sys

from .runtime.activation_checkpointing import checkpointing as _checkpointing

sys.modules[__name__] = _checkpointing
