"""DeepSpeed's ``deepspeed.runtime.zero.leaf_module_config``: the defaults of the
``zero_optimization.leaf_module`` config section (``config/sections.LeafModuleConfig``, also
named ``DeepSpeedZeroLeafModuleConfig`` here): the module classes marked as ZeRO-3 leaves by
default (transformers' sparse MoE blocks, whose experts a token batch uses only partly), names
and name suffixes (none by default). The engine applies the section when it is built
(``utils/z3_leaf_modules.apply_zero_leaf_module_config``).

Plain data without imports: the config schema reads it.
"""

DEFAULT_LEAF_MODULE_CLASSES: list[str] = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]
DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []


def __getattr__(name: str):
    # The section's class, under DeepSpeed's name; imported late (the schema imports this file).
    if name == "DeepSpeedZeroLeafModuleConfig":
        from ..config.sections import LeafModuleConfig

        return LeafModuleConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
