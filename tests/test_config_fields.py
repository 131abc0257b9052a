"""No config key is accepted and then ignored: every field of the schema is read by the engine,
refused ("not supported yet") or accepted with one warning (deepspeed_cpp/runtime/config/
field_policy.py), and fp16.auto_cast, which was validated but never read, now works."""

from __future__ import annotations

import inspect
import logging
import re

import pytest
import torch
from conftest import REPO_ROOT
from dist_pool import shared_pool

from deepspeed_cpp.runtime.config import DeepSpeedConfig
from deepspeed_cpp.runtime.config.deepspeed_config import forget_warnings
from deepspeed_cpp.runtime.config.field_policy import FIELDS, Use
from deepspeed_cpp.runtime.config.key_names import _nested_model
from deepspeed_cpp.runtime.config.optimizer import PARAMS_BY_TYPE as OPTIMIZER_PARAMS
from deepspeed_cpp.runtime.config.scheduler import PARAMS_BY_TYPE as SCHEDULER_PARAMS
from deepspeed_cpp.runtime.lr_schedules import _SCHEDULERS

PACKAGE = REPO_ROOT / "deepspeed_cpp"


def schema_fields(model, prefix: str = "") -> list[str]:
    """Every field's dotted attribute path; a section stands for its fields."""
    paths = []
    for name, field in model.model_fields.items():
        nested = _nested_model(field.annotation)
        if nested is None:
            paths.append(prefix + name)
        else:
            paths += schema_fields(nested, f"{prefix}{name}.")
    return paths


def _reads(path: str, use) -> bool:
    """Whether one of the modules the table names reads the field."""
    name = path.rsplit(".", 1)[-1]
    if path.startswith("optimizer.params."):
        pattern = re.compile(rf"[\"']{name}[\"']")  # read from the params dict by key
    elif use.use is Use.READ:
        pattern = re.compile(rf"\.{name}\b")  # read as an attribute of its section
    else:
        pattern = re.compile(rf"\b{name}\b")  # named by the check that judges it
    return any(pattern.search((PACKAGE / where).read_text()) for where in use.where)


def test_every_schema_field_is_read_refused_or_warned():
    from deepspeed_cpp.runtime.config import DeepSpeedConfig as Root

    fields = schema_fields(Root)
    for model in OPTIMIZER_PARAMS.values():
        fields += [f"optimizer.params.{name}" for name in model.model_fields]
    undecided, not_read = [], []
    for path in sorted(set(fields)):
        use = FIELDS.get(path)
        if use is None:
            undecided.append(path)
        elif use.use in (Use.READ, Use.JUDGED_IN) and not _reads(path, use):
            not_read.append(f"{path} ({use.use.value} in {', '.join(use.where)})")
    assert not undecided, f"fields with no decision in field_policy.FIELDS: {undecided}"
    assert not not_read, f"fields the table says are read or judged, but are not: {not_read}"
    assert not set(FIELDS) - set(fields), f"stale entries: {set(FIELDS) - set(fields)}"
    # scheduler.params.<name> are handed to the schedule's constructor by name.
    for kind, model in SCHEDULER_PARAMS.items():
        arguments = inspect.signature(_SCHEDULERS[kind].__init__).parameters
        missing = [name for name in model.model_fields if name not in arguments]
        assert not missing, f"scheduler {kind}: params no constructor argument reads: {missing}"


@pytest.fixture
def warnings_seen():
    forget_warnings()
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Collect(level=logging.WARNING)
    logging.getLogger("deepspeed_cpp").addHandler(handler)
    yield messages
    logging.getLogger("deepspeed_cpp").removeHandler(handler)


def _about(messages: list[str], key: str) -> list[str]:
    return [m for m in messages if m.startswith(f"'{key}'")]


def test_fixed_and_no_effect_keys_warn_once_per_process(warnings_seen):
    zero = {"stage": 2, "contiguous_gradients": False, "overlap_comm": False,
            "allgather_bucket_size": 200_000_000, "sub_group_size": 10**8}  # fmt: skip
    config = {"train_batch_size": 4, "zero_optimization": zero,
              "zero_allow_untested_optimizer": False}  # fmt: skip
    for _ in range(3):  # three engines' worth of configs in one process
        DeepSpeedConfig.load(config, world_size=2)
    expected = {
        "zero_optimization.contiguous_gradients": "false has no effect in deepspeed_cpp "
        "(gradients are always copied into their contiguous bucket",
        "zero_optimization.overlap_comm": "false has no effect in deepspeed_cpp (gradient "
        "reductions always run asynchronously",
        "zero_optimization.allgather_bucket_size": "200000000 has no effect in deepspeed_cpp "
        "(updated parameters are all-gathered bucket by bucket",
        "zero_optimization.sub_group_size": "100000000 has no effect without offload_optimizer",
        "zero_allow_untested_optimizer": "false has no effect in deepspeed_cpp (ZeRO runs any "
        "optimizer passed to initialize(); it behaves as true)",
    }
    for key, text in expected.items():
        said = _about(warnings_seen, key)
        assert len(said) == 1, (key, said)
        assert text in said[0], said[0]
    # The values deepspeed_cpp behaves as are accepted silently.
    forget_warnings()
    warnings_seen.clear()
    quiet = {"stage": 2, "contiguous_gradients": True, "overlap_comm": True,
             "ignore_unused_parameters": True}  # fmt: skip
    DeepSpeedConfig.load({"train_batch_size": 4, "zero_optimization": quiet})
    assert warnings_seen == []
    # With the optimizer offloaded, sub_group_size is read: no warning.
    offloaded = {"stage": 2, "sub_group_size": 10**8, "offload_optimizer": {"device": "cpu"}}
    DeepSpeedConfig.load({"train_batch_size": 4, "zero_optimization": offloaded})
    assert warnings_seen == []


def test_ignore_unused_parameters_false_is_read_silently():
    # Checked at the step where DeepSpeed checks it (tests/test_config_deepspeed_meanings.py).
    forget_warnings()
    zero = {"stage": 1, "ignore_unused_parameters": False}
    config = DeepSpeedConfig.load({"train_batch_size": 4, "zero_optimization": zero})
    assert config.zero_optimization.ignore_unused_parameters is False


def auto_cast_job(auto_cast: bool):
    import deepspeed_cpp as deepspeed

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "fp16": {"enabled": True, "auto_cast": auto_cast},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)  # fmt: skip
    x = torch.randn(2, 4)
    try:
        out = engine(x)
    except RuntimeError as error:
        return "error", str(error).splitlines()[0]
    expected = engine.module(x.half())
    seen = []
    handle = engine.module.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(
            (args[0].dtype, kwargs["extra"]["ids"].dtype, kwargs["extra"]["w"][0].dtype)
        ),
        with_kwargs=True,
    )
    engine.module.forward = lambda x, extra: torch.nn.Linear.forward(engine.module, x)
    engine(x, extra={"ids": torch.arange(3), "w": [torch.ones(2)]})
    handle.remove()
    return out.dtype, torch.equal(out, expected), engine.fp16_auto_cast(), seen


def test_fp16_auto_cast_casts_floating_inputs_only():
    pool = shared_pool(1)
    (cast,) = pool.run(auto_cast_job, True)
    (plain,) = pool.run(auto_cast_job, False)
    assert cast == (torch.float16, True, True, [(torch.float16, torch.int64, torch.float16)])
    assert plain[0] == "error"  # fp32 input into the fp16 module, as in DeepSpeed without it
