"""The DeepSpeed config (``ds_config.json``): a typed, validated schema built on pydantic.

    from deepspeed_cpp.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    cfg = DeepSpeedConfig.load(config="ds_config.json", world_size=2)    # finalised
    cfg.train_micro_batch_size_per_gpu, cfg.optimizer.type, cfg.zero_optimization.stage

    cfg = DeepSpeedConfig.parse(hf_config)                # "auto" values allowed
    cfg.fill_auto({"train_micro_batch_size_per_gpu": 8, "optimizer.params.lr": 3e-5})
    cfg = cfg.finalize(world_size)

Where each part lives: ``deepspeed_config.py`` (the top level, parse/finalize), ``sections.py``
(fp16, bf16, zero_optimization, aio), ``optimizer.py``, ``scheduler.py``, ``key_policy.py`` (the
decision for every DeepSpeed key that is not modelled), ``not_built_yet.py`` (the single place
refusing validated features the engine lacks), ``batch_size.py``, ``auto_values.py``,
``source.py`` (files, dicts, args), ``values.py`` (leaf types), ``errors.py``.
"""

from .deepspeed_config import DeepSpeedConfig
from .errors import DeepSpeedConfigError
from .optimizer import OptimizerConfig
from .param_dict_readers import (
    ADAGRAD_OPTIMIZER,
    ADAM_OPTIMIZER,
    ADAMW_OPTIMIZER,
    LAMB_OPTIMIZER,
    LION_OPTIMIZER,
    get_gradient_accumulation_steps,
    get_gradient_clipping,
    get_optimizer_name,
    get_optimizer_params,
    get_scheduler_name,
    get_scheduler_params,
    get_steps_per_print,
    get_train_batch_size,
    get_train_micro_batch_size_per_gpu,
)
from .scheduler import SchedulerConfig
from .sections import (
    AioConfig,
    BF16Config,
    FP16Config,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    ZeroConfig,
)

__all__ = [
    "ADAGRAD_OPTIMIZER",
    "ADAMW_OPTIMIZER",
    "ADAM_OPTIMIZER",
    "LAMB_OPTIMIZER",
    "LION_OPTIMIZER",
    "AioConfig",
    "BF16Config",
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "FP16Config",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZeroConfig",
    "get_gradient_accumulation_steps",
    "get_gradient_clipping",
    "get_optimizer_name",
    "get_optimizer_params",
    "get_scheduler_name",
    "get_scheduler_params",
    "get_steps_per_print",
    "get_train_batch_size",
    "get_train_micro_batch_size_per_gpu",
]
