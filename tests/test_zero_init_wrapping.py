"""zero.Init's wrapping of module classes is invisible to what inspects them.

transformers' ``@auto_docstring`` reads the signature of each model class's ``__init__`` when the
class is defined; a model module first imported inside ``zero.Init`` (as ``from_config`` and
``from_pretrained_zero3`` import it) has its classes defined while their ``__init__`` is wrapped.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_model_module_first_imported_under_zero_init_prints_no_docstring_errors(tmp_path):
    """A fresh process (the model module not yet imported) builds a tiny GPT-2 with
    ``from_pretrained_zero3``, the documented route: transformers printed "[ERROR] `module` is
    part of Init._wrap.<locals>.init_then_partition's signature" 7 times. The wrapped __init__
    shows the class's own signature, and the docstring transformers writes for it while wrapped
    stays with the class after the block."""
    script = textwrap.dedent(
        """
        import inspect
        import sys
        from transformers import GPT2Config
        from deepspeed_cpp import hf
        from deepspeed_cpp.integrations.hf.pretrained_zero3 import from_pretrained_zero3

        folder = sys.argv[1]
        config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8,
                            bos_token_id=0, eos_token_id=0)
        config.save_pretrained(folder)
        import safetensors.torch, torch
        torch.manual_seed(0)
        # The weights a plain GPT2LMHeadModel has, written without importing its module here.
        keeper = hf.HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1,
                                       "zero_optimization": {"stage": 3}})
        assert "transformers.models.gpt2.modeling_gpt2" not in sys.modules
        with keeper.zero_init():
            from transformers.models.gpt2 import modeling_gpt2
        wrapped_during = modeling_gpt2.GPT2LMHeadModel.__init__
        print("SIGNATURE", list(inspect.signature(wrapped_during).parameters))
        print("DOC", "GPT2Config" in (wrapped_during.__doc__ or ""))
        model = modeling_gpt2.GPT2LMHeadModel(config)
        safetensors.torch.save_model(model, folder + "/model.safetensors")
        loaded = from_pretrained_zero3(modeling_gpt2.GPT2LMHeadModel, folder)
        print("LOADED", type(loaded).__name__)
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-6000:]
    assert "[ERROR]" not in run.stdout, run.stdout[-6000:]
    assert "SIGNATURE ['self', 'config']" in run.stdout, run.stdout[-6000:]
    assert "DOC True" in run.stdout, run.stdout[-6000:]
    assert "LOADED GPT2LMHeadModel" in run.stdout


def test_wrapped_init_keeps_the_class_signature_and_still_partitions():
    """Inside the block the wrapper stands in for ``__init__`` with its name, signature and
    docstring; after the block the class's own ``__init__`` is back."""
    import inspect

    import torch

    from deepspeed_cpp import zero

    class Documented(torch.nn.Module):
        def __init__(self, width: int, bias: bool = True):
            """Documented layer."""
            super().__init__()
            self.layer = torch.nn.Linear(width, width, bias=bias)

    original = Documented.__init__
    with zero.Init(config_dict_or_path={"zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}}):  # fmt: skip
        wrapped = Documented.__init__
        assert wrapped is not original
        assert list(inspect.signature(wrapped).parameters) == ["self", "width", "bias"]
        assert wrapped.__doc__ == "Documented layer."
        assert wrapped.__qualname__ == original.__qualname__
        module = Documented(64)
    assert Documented.__init__ is original
    assert hasattr(module.layer.weight, "ds_tensor"), "still partitioned when built"
