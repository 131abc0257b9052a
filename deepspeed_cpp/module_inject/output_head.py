"""Which output head AutoTP training splits by vocabulary: DeepSpeed 0.19.8's rule.

DeepSpeed's training AutoTP makes an ``nn.Linear`` whose last name is ``lm_head`` or
``embed_out`` column-parallel over the vocabulary, with its logits gathered so that the loss is
computed on whole logits (``LinearLayer(..., gather_output=True)``; transformers' plan for Llama
says the same, ``"lm_head": "colwise_gather_output"``), except when its weight is tied to an
embedding: then the head and the embedding stay replicated, as the tie needs one whole tensor.
(DeepSpeed's opt-in ``vocab_parallel_lm_head``, which keeps the logits split and computes a
distributed loss, is not built here.)

One difference: DeepSpeed cuts a vocabulary that the TP size does not divide into uneven
slices; here such a head stays replicated (every rank's slice of a gathered output must have one
size), which keeps the loss exact and costs only memory.
"""

from __future__ import annotations

import torch

from ..utils.logging import logger

HEAD_NAMES = ("lm_head", "embed_out")


def _tied_to_an_embedding(model: torch.nn.Module, weight: torch.Tensor) -> bool:
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    get_input_embeddings = getattr(model, "get_input_embeddings", None)
    if callable(get_input_embeddings):
        try:
            embeddings.append(get_input_embeddings())
        except (NotImplementedError, AttributeError):
            pass
    return any(getattr(e, "weight", None) is weight for e in embeddings if e is not None)


def splits_output_head(model: torch.nn.Module, name: str, module, tp_size: int) -> bool:
    """Whether ``module`` (named ``name`` in ``model``) is an output head that TP ``tp_size``
    splits by vocabulary (see the module docstring)."""
    if name.rsplit(".", 1)[-1] not in HEAD_NAMES or type(module) is not torch.nn.Linear:
        return False
    if _tied_to_an_embedding(model, module.weight):
        return False
    vocabulary = module.weight.shape[0]
    if vocabulary % tp_size != 0:
        logger.info(
            "deepspeed_cpp: %s (vocabulary %d) kept whole on every rank: the tensor-parallel "
            "size %d does not divide its vocabulary",
            name,
            vocabulary,
            tp_size,
        )
        return False
    return True
