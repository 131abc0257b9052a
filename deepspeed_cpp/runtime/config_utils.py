"""DeepSpeed's ``deepspeed.runtime.config_utils.DeepSpeedConfigModel``: the base of its config
section classes. Here the base of ours (``config/values.py``'s ``ConfigSection``: a pydantic model
refusing unknown keys and taking DeepSpeed's aliases); DeepSpeed's ``deprecated``/``new_param``
field migration is not modelled (deprecated keys are handled in ``config/key_policy.py``)."""

from .config.values import ConfigSection as DeepSpeedConfigModel

__all__ = ["DeepSpeedConfigModel"]
