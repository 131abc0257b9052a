"""``from deepspeed_cpp.hf import Trainer, TrainingArguments``: the Hugging Face Trainer drop-in
(``deepspeed_cpp.integrations.hf``). Needs ``pip install deepspeed_cpp[hf]``."""

from .integrations.hf import *  # noqa: F403
from .integrations.hf import __all__  # noqa: F401
