"""ZeRO-3 leaf modules (``deepspeed_cpp.utils.set_z3_leaf_modules`` & co.): the marking API, and
a marked Mixture-of-Experts block gathered as one unit on a real 2-process gloo group (jobs in
z3_leaf_jobs.py)."""

from __future__ import annotations

import pytest
import torch
import z3_leaf_jobs as jobs

from deepspeed_cpp.utils import (
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    unset_z3_leaf_modules,
    z3_leaf_module,
)


def test_marks_by_class_and_by_name():
    model = jobs.MoeNet()
    assert get_z3_leaf_modules(model) == [] and not z3_leaf_module(model.moe)
    assert set_z3_leaf_modules(model, [torch.nn.Linear]) == [
        model.embed, *model.moe.experts, model.head
    ]  # fmt: skip
    assert unset_z3_leaf_modules(model, ["torch.nn.modules.linear.Linear"]) == [
        model.embed, *model.moe.experts, model.head
    ]  # fmt: skip
    assert set_z3_leaf_modules(model, ["Experts"]) == [model.moe]
    assert z3_leaf_module(model.moe) and model.moe._z3_leaf is True  # DeepSpeed's attribute
    assert get_z3_leaf_modules(model) == [model.moe]


def test_no_match_is_an_error_unless_allowed():
    model = jobs.MoeNet()
    with pytest.raises(ValueError, match="Conv2d"):
        set_z3_leaf_modules(model, [torch.nn.Conv2d])
    assert set_z3_leaf_modules(model, [torch.nn.Conv2d], raise_if_not_found=False) == []
    with pytest.raises(TypeError, match="classes or class names"):
        set_z3_leaf_modules(model, [3])


def test_marks_by_module_name_and_by_name_suffix():
    from deepspeed_cpp.utils import set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix

    model = jobs.MoeNet()
    assert set_z3_leaf_modules_by_name(model, ["moe", "head"]) == ([model.moe, model.head], [])
    assert get_z3_leaf_modules(model) == [model.moe, model.head]
    unmarked = set_z3_leaf_modules_by_name(model, ["head", "nope"], False, False)
    assert unmarked == ([model.head], ["nope"])
    with pytest.raises(ValueError, match=r"\['nope'\]"):
        set_z3_leaf_modules_by_name(model, ["nope"])
    experts = list(model.moe.experts)
    suffixes = ["experts.0", "experts.1", "zzz"]
    matched, missing = set_z3_leaf_modules_by_suffix(model, suffixes, raise_if_not_found=False)
    assert matched == experts[:2] and missing == ["zzz"]
    assert all(z3_leaf_module(m) for m in experts[:2])
    with pytest.raises(ValueError, match="zzz"):
        set_z3_leaf_modules_by_suffix(model, ["zzz"])


@pytest.mark.parametrize("mark_by", ["class", "name", "config"])
def test_leaf_block_is_one_unit_and_trains_like_the_reference(pool2, mark_by):
    result = pool2.run(jobs.leaf_block_trains, mark_by)[0]
    # embed, the Experts block (its three experts together), head.
    assert result == {"compared": 2 * 10, "units": 3}


def test_leaf_module_config_section():
    """``zero_optimization.leaf_module`` as DeepSpeed parses it: DeepSpeed's defaults, one string
    for a list of one, repeats dropped; anything else refused naming the key."""
    from deepspeed_cpp.runtime.config import DeepSpeedConfig
    from deepspeed_cpp.runtime.config.errors import DeepSpeedConfigError
    from deepspeed_cpp.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed_cpp.runtime.zero.leaf_module_config import (
        DEFAULT_LEAF_MODULE_CLASSES,
        DeepSpeedZeroLeafModuleConfig,
    )

    default = DeepSpeedZeroConfig().leaf_module
    assert isinstance(default, DeepSpeedZeroLeafModuleConfig)
    assert (default.classes, default.names, default.name_suffixes) == (
        DEFAULT_LEAF_MODULE_CLASSES, [], []
    )  # fmt: skip
    given = {"classes": "my.Block", "names": ["a.b", "a.b", "c"], "name_suffixes": "experts"}
    section = DeepSpeedZeroConfig(leaf_module=given).leaf_module
    assert (section.classes, section.names, section.name_suffixes) == (
        ["my.Block"], ["a.b", "c"], ["experts"]
    )  # fmt: skip
    for bad in ({"classes": [3]}, {"names": {"x": 1}}, {"suffixes": ["x"]}):
        with pytest.raises(DeepSpeedConfigError, match="leaf_module"):
            DeepSpeedConfig.parse({"zero_optimization": {"leaf_module": bad}})


def test_leaf_module_config_names_nothing_warns(caplog):
    from deepspeed_cpp.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed_cpp.utils.z3_leaf_modules import apply_zero_leaf_module_config

    model = jobs.MoeNet()
    # The default classes (transformers' MoE blocks) are in no model here: no warning for them.
    assert apply_zero_leaf_module_config(model, DeepSpeedZeroConfig().leaf_module) == []
    assert "leaf_module" not in caplog.text
    section = DeepSpeedZeroConfig(leaf_module={"names": ["moe", "nope"]}).leaf_module
    assert apply_zero_leaf_module_config(model, section) == [model.moe]
    assert "['nope']" in caplog.text and z3_leaf_module(model.moe)
