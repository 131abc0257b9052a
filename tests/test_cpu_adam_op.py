"""The cpu_adam op against torch's Adam/AdamW in float64, plus opcheck, compile and bad input."""

import itertools
import os
import subprocess
import sys

import pytest
import torch
from adam_reference import reference_adam_steps
from cpu_isa_levels import supported_isa_levels

from deepspeed_cpp.ops import cpu_adam_step, cpu_adam_step_multi
from deepspeed_cpp.ops.cpu_adam import cpu_adam_isa, load_cpu_adam

SIZES = [1, 7, 15, 16, 17, 63, 64, 65, 4095, 2**20 + 3]
MODES = [
    dict(adamw_mode=adamw, bias_correction=bc, weight_decay=wd)
    for adamw, bc, wd in itertools.product([True, False], [True, False], [0.0, 0.1])
]
STEPS = 50


def _run_ours(param, grads, **hp):
    p = param.clone()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    for step, g in enumerate(grads, start=1):
        cpu_adam_step(p, g, m, v, step=step, **hp)
    return p


def _mode_id(mode: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in mode.items())


# Every mode at every size up to 4095 (the vector widths, their tails, one thread); the size over
# 2^20, which the op splits across threads, in the two modes furthest apart (AdamW with bias
# correction and weight decay; Adam with L2 weight decay and no bias correction): the per-element
# arithmetic of a mode is the same in every thread's chunk, and each large case costs more than
# all the small ones of its mode together.
LARGE = SIZES[-1]
FLOAT64_CASES = [(mode, size) for mode in MODES for size in SIZES[:-1]] + [
    (mode, LARGE) for mode in (MODES[1], MODES[-1])
]


@pytest.mark.parametrize(
    "mode, size", FLOAT64_CASES, ids=[f"{_mode_id(m)}-{s}" for m, s in FLOAT64_CASES]
)
def test_matches_torch_float64(size, mode):
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, **mode)
    param = torch.randn(size)
    # Gradients of varied magnitude per step, so that exp_avg_sq and eps both matter.
    grads = [torch.randn(size) * torch.empty(1).uniform_(0.01, 2) for _ in range(STEPS)]
    ours = _run_ours(param, grads, **hp)
    reference_hp = dict(
        lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
        weight_decay=mode["weight_decay"], adamw_mode=mode["adamw_mode"],
        bias_correction=mode["bias_correction"],
    )  # fmt: skip
    reference, path_max = reference_adam_steps(param, grads, return_path_max=True, **reference_hp)
    # The same reference run in float32 (torch's own optimizer where it has the mode) measures
    # how much float32 rounding alone moves the result; ours may not be worse than that.
    fp32_reference = reference_adam_steps(param, grads, dtype=torch.float32, **reference_hp)
    fp32_error = (fp32_reference.double() - reference).abs().max().item()
    error = (ours.double() - reference).abs().max().item()
    # Rounding errors scale with the magnitudes the parameters pass through on the way: with one
    # element, start and end can both be near zero after a path far from it.
    scale = path_max.max().item()
    # + 4 float32 ulps of that scale: with a handful of elements torch's own error can be zero
    # by luck, which no other float32 implementation could be asked to match.
    # Without bias correction the first steps divide by tiny second moments and amplify every
    # rounding difference; there two correct float32 orders of operations differ by up to ~3x.
    ratio = 1.5 if mode["bias_correction"] else 4.0
    assert error <= ratio * fp32_error + 4 * 2**-23 * scale, (
        f"max |ours - float64 reference| = {error:.3e}, torch float32: {fp32_error:.3e}"
    )
    # Sanity bound. Without bias correction in L2 mode the first steps divide by tiny second
    # moments, so float32 rounding alone reaches ~2e-5 relative there; the tight check is above.
    assert error <= 1e-4 * scale


def test_multi_tensor_equals_single_tensor_bitwise():
    shapes = [(3, 5), (1,), (4095,), (17, 65), (2**16 + 1,)]
    params = [torch.randn(s) for s in shapes]
    grads = [torch.randn(s) for s in shapes]
    singles = [p.clone() for p in params]
    m1, v1 = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    m2, v2 = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    hp = dict(lr=3e-3, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.05)
    for step in (1, 2, 3):
        cpu_adam_step_multi(params, grads, m1, v1, step=step, **hp)
        for p, g, m, v in zip(singles, grads, m2, v2):
            cpu_adam_step(p, g, m, v, step=step, **hp)
    for a, b in zip(params + m1 + v1, singles + m2 + v2):
        assert torch.equal(a, b)


def test_bitwise_identical_for_one_and_two_threads():
    n = 2**20 + 3
    param, grad = torch.randn(n), torch.randn(n)
    results = []
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            p, m, v = param.clone(), torch.zeros(n), torch.zeros(n)
            for step in range(1, 4):
                cpu_adam_step(p, grad, m, v, step=step, lr=1e-3, weight_decay=0.01)
            results.append((p, m, v))
    finally:
        torch.set_num_threads(previous)
    for a, b in zip(*results):
        assert torch.equal(a, b)


_ISA_SCRIPT = """
import sys, torch
from deepspeed_cpp.ops import cpu_adam_step
from deepspeed_cpp.ops.cpu_adam import cpu_adam_isa
torch.manual_seed(int(sys.argv[1]))
n = 100003
p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
for step in range(1, 4):
    cpu_adam_step(p, g, m, v, step=step, lr=1e-3, weight_decay=0.01, adamw_mode=step % 2 == 0)
torch.save({"isa": cpu_adam_isa(), "p": p, "m": m, "v": v}, sys.argv[2])
"""


def test_bitwise_identical_across_isa_levels(tmp_path):
    seed = int(torch.randint(0, 2**31, (1,)))
    outputs = {}
    for level in supported_isa_levels():
        out = tmp_path / f"{level}.pt"
        env = dict(os.environ, DS_CPU_ISA=level)
        subprocess.run([sys.executable, "-c", _ISA_SCRIPT, str(seed), str(out)], env=env,
                       check=True)  # fmt: skip
        outputs[level] = torch.load(out)
        assert outputs[level]["isa"] == level
    first = outputs["scalar"]
    for level, result in outputs.items():
        for key in ("p", "m", "v"):
            assert torch.equal(result[key], first[key]), f"{level} differs from scalar in {key}"


def test_isa_level_reported():
    assert cpu_adam_isa() in ("scalar", "avx2", "avx512")


def test_opcheck_single_and_multi():
    load_cpu_adam()
    n = 37
    single = (torch.randn(n), torch.randn(n), torch.randn(n), torch.rand(n), 3, 1e-3, 0.9, 0.999,
              1e-8, 0.01, True, True)  # fmt: skip
    torch.library.opcheck(torch.ops.deepspeed_cpp.cpu_adam_step.default, single)
    sizes = [n, 5, 1]
    multi = ([torch.randn(s) for s in sizes], [torch.randn(s) for s in sizes],
             [torch.randn(s) for s in sizes], [torch.rand(s) for s in sizes],
             2, 1e-3, 0.9, 0.999, 1e-8, 0.0, False, False)  # fmt: skip
    torch.library.opcheck(torch.ops.deepspeed_cpp.cpu_adam_step_multi.default, multi)


def test_torch_compile_fullgraph():
    load_cpu_adam()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def compiled_step(p, g, m, v):
        cpu_adam_step(p, g * 2, m, v, step=1, lr=1e-2)
        return p.sum()

    p, g = torch.randn(65), torch.randn(65)
    p_ref, m_ref, v_ref = p.clone(), torch.zeros(65), torch.zeros(65)
    cpu_adam_step(p_ref, g * 2, m_ref, v_ref, step=1, lr=1e-2)
    m, v = torch.zeros(65), torch.zeros(65)
    total = compiled_step(p, g, m, v)
    assert torch.equal(p, p_ref) and torch.equal(m, m_ref) and torch.equal(v, v_ref)
    assert torch.allclose(total, p_ref.sum())


def _args(n=8, **overrides):
    args = dict(param=torch.randn(n), grad=torch.randn(n), exp_avg=torch.zeros(n),
                exp_avg_sq=torch.zeros(n))  # fmt: skip
    args.update(overrides)
    return args


def _strided(n):
    return torch.zeros(n, 2)[:, 0]  # n elements, not contiguous


@pytest.mark.parametrize(
    "overrides, hp, message",
    [
        (
            dict(grad=torch.randn(8).double()),
            {},
            "grad must be float32, bfloat16 or float16, got dtype Double",
        ),
        (dict(exp_avg=torch.zeros(9)), {}, "exp_avg has 9 elements (shape [9]) but the param"),
        (dict(param=_strided(8)), {}, "param must be contiguous, got strides [2]"),
        (dict(exp_avg_sq=_strided(8)), {}, "exp_avg_sq must be contiguous"),
        ({}, dict(lr=-1.0), "lr must be >= 0, got -1"),
        ({}, dict(beta1=1.0), "beta1 must be in [0, 1), got 1"),
        ({}, dict(beta2=-0.1), "beta2 must be in [0, 1), got -0.1"),
        ({}, dict(step=0), "step must be >= 1"),
        ({}, dict(eps=-1e-8), "eps must be >= 0"),
        ({}, dict(weight_decay=-0.5), "weight_decay must be >= 0, got -0.5"),
    ],
)
def test_bad_input_names_argument_value_and_expectation(overrides, hp, message):
    args = _args(**overrides)
    kwargs = dict(step=1, lr=1e-3)
    kwargs.update(hp)
    with pytest.raises(RuntimeError) as error:
        cpu_adam_step(**args, **kwargs)
    assert message in str(error.value)


def test_bad_device_is_named():
    args = _args(grad=torch.randn(8, device="meta"))
    with pytest.raises(ValueError, match="grad must be a CPU tensor, got device meta"):
        cpu_adam_step(**args, step=1, lr=1e-3)


def test_multi_lists_of_unequal_length():
    with pytest.raises(RuntimeError, match="equal lengths, got params=2, grads=1"):
        cpu_adam_step_multi([torch.randn(3)] * 2, [torch.randn(3)], [torch.zeros(3)] * 2,
                            [torch.zeros(3)] * 2, step=1, lr=1e-3)  # fmt: skip


def test_multi_error_names_the_list_index():
    params = [torch.randn(3), torch.randn(4)]
    grads = [torch.randn(3), torch.randn(5)]
    with pytest.raises(RuntimeError, match=r"grad\[1\] has 5 elements"):
        cpu_adam_step_multi(params, grads, [torch.zeros(3), torch.zeros(4)],
                            [torch.zeros(3), torch.zeros(4)], step=1, lr=1e-3)  # fmt: skip
