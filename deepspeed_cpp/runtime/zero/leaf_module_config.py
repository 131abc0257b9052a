"""DeepSpeed's ``deepspeed.runtime.zero.leaf_module_config`` defaults: the module classes DeepSpeed
marks as ZeRO-3 leaves by default (transformers' sparse MoE blocks, whose experts a token batch
uses only partly), names and name suffixes (none by default).

deepspeed_cpp has no ``zero_optimization.leaf_module`` config section: mark leaves with
``deepspeed.utils.set_z3_leaf_modules`` (transformers does so for these MoE blocks itself).
"""

DEFAULT_LEAF_MODULE_CLASSES: list[str] = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]
DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []
