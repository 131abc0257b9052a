"""cpu_adam's storage types (bf16/fp16 params and grads, bf16 state), the low-precision copy-out,
gradient unscaling and the found_inf skip; and every CPU optimizer and storage type giving the
same bits at every ISA level.

The low-precision paths are defined as "the float32 step on the widened values, rounded like
tensor.to(dtype)", and are checked bit for bit against exactly that: torch's own conversions
around the float32 step, which test_cpu_adam_op.py checks against torch's float64 Adam."""

import os
import struct
import subprocess
import sys

import pytest
import torch
from adam_reference import reference_adam_steps
from cpu_isa_levels import supported_isa_levels

from deepspeed_cpp.ops import cpu_adam_step, cpu_adam_step_multi
from deepspeed_cpp.ops.cpu_adam import load_cpu_adam

HP = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05)
SIZES = [1, 15, 33, 1000, 2**16 + 7]
LOW = [torch.bfloat16, torch.float16]


def _state(n, dtype=torch.float32):
    # Non-zero state, so that rounding the state to bfloat16 matters from the first step.
    return torch.randn(n).to(dtype), torch.rand(n).mul(1e-3).to(dtype)


def _from_bits(bits):
    return torch.tensor([struct.unpack("<f", struct.pack("<I", b))[0] for b in bits])


def _special_values():
    """float32 values around every rounding edge of bfloat16 and float16."""
    bits = [
        0x00000001, 0x80000001, 0x007FFFFF, 0x00800000,  # float32 subnormals, smallest normal
        0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF,  # bf16: rounds to inf / stays finite
        0x3F808000, 0x3F818000, 0x3F808001, 0x3F80C000,  # bf16 ties to even, above tie
        0x477FF000, 0x477FEFFF, 0xC77FF000, 0x47800000,  # fp16: 65520 -> inf, 65519.99 -> max
        0x33800000, 0x33000000, 0x33000001, 0x33C00000,  # fp16 subnormal edges: 2^-24, ties
        0x38800000, 0x387FE000, 0x387FF000, 0x387FFFFF,  # fp16 smallest normal and just below
        0x7FC00000, 0xFFC00000, 0x7FA12345, 0xFF812345,  # NaNs, quiet and signalling payloads
        0x7F800000, 0xFF800000, 0x00000000, 0x80000000,  # infinities and zeros
    ]  # fmt: skip
    random = torch.randn(64) * torch.logspace(-45, 38, 64, base=2.0)
    return torch.cat([_from_bits(bits), random])


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_copy_out_rounds_exactly_like_tensor_to(dtype):
    # lr = 0 and no weight decay leave every finite param unchanged, so the copy is a pure
    # rounding of the float32 param. (Infinite params turn into NaN through 0 * inf, so the
    # infinities are checked on the rounding edge only: values that round to inf.)
    values = _special_values()
    values = values[~values.isinf()].repeat(3)  # long enough for vector bodies and tails
    param = values.clone()
    lowp = torch.empty(param.shape, dtype=dtype)
    cpu_adam_step(param, torch.zeros_like(param), torch.zeros_like(param), torch.zeros_like(param),
                  step=1, lr=0.0, param_lowp=lowp)  # fmt: skip
    expected = values.to(dtype)  # contiguous: torch's vectorised conversion
    finite = ~values.isnan()
    assert torch.equal(lowp.view(torch.int16)[finite], expected.view(torch.int16)[finite])
    assert lowp[~finite].isnan().all()
    if dtype == torch.bfloat16:  # torch's NaN is 0xFFFF; ours is the same
        assert (lowp.view(torch.int16)[~finite] == -1).all()
    else:  # float16 NaN keeps sign and top payload bits, quiet (F16C)
        assert torch.equal(lowp.view(torch.int16)[~finite], expected.view(torch.int16)[~finite])


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, *LOW], ids=str)
@pytest.mark.parametrize("param_dtype", [torch.float32, *LOW], ids=str)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_low_precision_step_is_the_float32_step_rounded(size, grad_dtype, param_dtype,
                                                        state_dtype):  # fmt: skip
    param = torch.randn(size).to(param_dtype)
    grad = torch.randn(size).to(grad_dtype)
    exp_avg, exp_avg_sq = _state(size, state_dtype)
    copy_dtype = torch.bfloat16 if param_dtype == torch.float32 else None
    # Reference: widen, float32 step, round with torch.
    # (copy=True: .float() of a float32 tensor would alias it)
    p32, m32, v32 = (t.to(torch.float32, copy=True) for t in (param, exp_avg, exp_avg_sq))
    cpu_adam_step(p32, grad.float(), m32, v32, step=3, **HP)
    lowp = None if copy_dtype is None else torch.empty(size, dtype=copy_dtype)
    cpu_adam_step(param, grad, exp_avg, exp_avg_sq, step=3, param_lowp=lowp, **HP)
    assert torch.equal(param, p32.to(param_dtype))
    assert torch.equal(exp_avg, m32.to(state_dtype))
    assert torch.equal(exp_avg_sq, v32.to(state_dtype))
    if lowp is not None:
        assert torch.equal(lowp, p32.to(copy_dtype))


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16], ids=str)
def test_grad_scale_multiplies_by_the_float32_reciprocal(grad_dtype):
    n, scale = 4099, 3.0 * 2**12  # a scale whose reciprocal is not a power of two
    param, grad = torch.randn(n), (torch.randn(n) * scale).to(grad_dtype)
    m, v = _state(n)
    p_ref, m_ref, v_ref = param.clone(), m.clone(), v.clone()
    unscaled = grad.float() * torch.tensor(1.0 / scale, dtype=torch.float32)
    cpu_adam_step(p_ref, unscaled, m_ref, v_ref, step=2, **HP)
    cpu_adam_step(param, grad, m, v, step=2, grad_scale=scale, **HP)
    assert torch.equal(param, p_ref) and torch.equal(m, m_ref) and torch.equal(v, v_ref)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("grad_dtype", [torch.float32, *LOW], ids=str)
def test_found_inf_skips_the_whole_step(bad, grad_dtype):
    shapes = [(5,), (40000,), (3, 7)]
    params = [torch.randn(s) for s in shapes]
    grads = [torch.randn(s).to(grad_dtype) for s in shapes]
    grads[1].view(-1)[int(torch.randint(0, 40000, ()))] = bad  # somewhere in a middle work item
    states = [_state(p.numel()) for p in params]
    exp_avgs = [m.view(p.shape) for (m, _), p in zip(states, params)]
    exp_avg_sqs = [v.view(p.shape) for (_, v), p in zip(states, params)]
    lowps = [torch.zeros(s, dtype=torch.bfloat16) for s in shapes]
    before = [t.clone() for t in params + exp_avgs + exp_avg_sqs + lowps]
    found_inf = torch.zeros(1)
    cpu_adam_step_multi(params, grads, exp_avgs, exp_avg_sqs, step=1, params_lowp=lowps,
                        found_inf=found_inf, **HP)  # fmt: skip
    assert found_inf.item() == 1.0
    for a, b in zip(params + exp_avgs + exp_avg_sqs + lowps, before):
        assert torch.equal(a, b)


def test_found_inf_finite_grads_step_normally_and_a_set_flag_skips():
    n = 3001
    param, grad = torch.randn(n), torch.randn(n) * 1e3
    m, v = _state(n)
    p_ref, m_ref, v_ref = param.clone(), m.clone(), v.clone()
    cpu_adam_step(p_ref, grad, m_ref, v_ref, step=4, grad_scale=8.0, **HP)
    found_inf = torch.full((1,), 7.0)  # any stale value is overwritten
    found_inf.zero_()
    cpu_adam_step(param, grad, m, v, step=4, grad_scale=8.0, found_inf=found_inf, **HP)
    assert found_inf.item() == 0.0
    assert torch.equal(param, p_ref) and torch.equal(m, m_ref) and torch.equal(v, v_ref)
    # A flag that is already set (for example by another rank's check) makes the call a no-op.
    found_inf.fill_(1.0)
    cpu_adam_step(param, grad, m, v, step=5, found_inf=found_inf, **HP)
    assert found_inf.item() == 1.0 and torch.equal(param, p_ref)


def test_unscaled_overflow_counts_as_inf():
    # A finite gradient that overflows once divided by a loss scale below 1.
    param, grad, (m, v) = torch.randn(17), torch.full((17,), 3e38), _state(17)
    found_inf = torch.zeros(1)
    cpu_adam_step(param, grad, m, v, step=1, grad_scale=0.5, found_inf=found_inf, **HP)
    assert found_inf.item() == 1.0


@pytest.mark.parametrize("param_dtype", LOW, ids=str)
def test_low_precision_training_tracks_float64(param_dtype):
    # Pure low-precision params (no master copy): each step rounds the param once, by at most half
    # an ulp of its size then (at most |final| + steps * lr), so the drift from float64 is bounded
    # by that many roundings; an update lost to rounding would move it by ~lr per step instead.
    n, steps = 2**12 + 1, 20
    param = torch.randn(n).to(param_dtype)
    grads = [torch.randn(n) for _ in range(steps)]
    m, v = torch.zeros(n), torch.zeros(n)
    ours = param.clone()
    for step, g in enumerate(grads, start=1):
        cpu_adam_step(ours, g.to(param_dtype), m, v, step=step, **HP)
    reference = reference_adam_steps(
        param.double(), [g.to(param_dtype) for g in grads], lr=HP["lr"],
        betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], weight_decay=HP["weight_decay"],
        adamw_mode=True, bias_correction=True,
    )  # fmt: skip
    ulp = torch.finfo(param_dtype).eps
    bound = steps * (ulp / 2) * (reference.abs() + steps * HP["lr"])
    assert ((ours.double() - reference).abs() <= bound).all()


def test_opcheck_with_copy_out_scale_and_flag():
    load_cpu_adam()
    n = 37
    single = (torch.randn(n), torch.randn(n, dtype=torch.bfloat16), torch.randn(n),
              torch.rand(n), 3, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, True)  # fmt: skip
    kwargs = dict(param_lowp=torch.empty(n, dtype=torch.float16), grad_scale=4.0,
                  found_inf=torch.zeros(1))  # fmt: skip
    torch.library.opcheck(torch.ops.deepspeed_cpp.cpu_adam_step.default, single, kwargs)
    sizes = [n, 5]
    multi = ([torch.randn(s) for s in sizes], [torch.randn(s) for s in sizes],
             [torch.randn(s, dtype=torch.bfloat16) for s in sizes],
             [torch.rand(s, dtype=torch.bfloat16) for s in sizes],
             2, 1e-3, 0.9, 0.999, 1e-8, 0.0, False, False)  # fmt: skip
    kwargs = dict(params_lowp=[torch.empty(s, dtype=torch.bfloat16) for s in sizes],
                  grad_scale=2.0, found_inf=torch.zeros(1))  # fmt: skip
    torch.library.opcheck(torch.ops.deepspeed_cpp.cpu_adam_step_multi.default, multi, kwargs)


def _adam_args(n=8):
    return dict(param=torch.randn(n), grad=torch.randn(n), exp_avg=torch.zeros(n),
                exp_avg_sq=torch.zeros(n))  # fmt: skip


@pytest.mark.parametrize(
    "overrides, kwargs, message",
    [
        (
            dict(exp_avg_sq=torch.zeros(8, dtype=torch.float16)),
            {},
            "exp_avg_sq must be float32 or bfloat16, got dtype Half",
        ),
        (
            dict(exp_avg_sq=torch.zeros(8, dtype=torch.bfloat16)),
            {},
            "exp_avg_sq has dtype BFloat16 but exp_avg has dtype Float; they must share one dtype",
        ),
        (
            dict(param=torch.randn(8, dtype=torch.bfloat16)),
            dict(param_lowp=torch.empty(8, dtype=torch.bfloat16)),
            "param_lowp is only for float32 params",
        ),
        (
            {},
            dict(param_lowp=torch.empty(8)),
            "param_lowp must be bfloat16 or float16, got dtype Float",
        ),
        ({}, dict(param_lowp=torch.empty(9, dtype=torch.bfloat16)), "param_lowp has 9 elements"),
        (
            {},
            dict(grad_scale=0.0),
            "grad_scale must be a finite number > 0 (the loss scale), got 0",
        ),
        ({}, dict(grad_scale=float("inf")), "grad_scale must be a finite number > 0"),
        ({}, dict(found_inf=torch.zeros(2)), "found_inf must be a one-element float32 CPU tensor"),
        (
            {},
            dict(found_inf=torch.zeros(1, dtype=torch.float64)),
            "found_inf must be a one-element",
        ),
    ],
)
def test_bad_precision_arguments_are_named(overrides, kwargs, message):
    args = _adam_args()
    args.update(overrides)
    with pytest.raises(RuntimeError) as error:
        cpu_adam_step(**args, step=1, lr=1e-3, **kwargs)
    assert message in str(error.value)


def test_mixed_dtypes_in_one_list_name_the_index():
    params = [torch.randn(3), torch.randn(4, dtype=torch.bfloat16)]
    with pytest.raises(RuntimeError, match=r"param\[1\] has dtype BFloat16 but param\[0\] has "
                                           r"dtype Float"):  # fmt: skip
        cpu_adam_step_multi(params, [torch.randn(3), torch.randn(4)],
                            [torch.zeros(3), torch.zeros(4)], [torch.zeros(3), torch.zeros(4)],
                            step=1, lr=1e-3)  # fmt: skip


# --- every optimizer and storage type, every ISA level --------------------------------------

_ISA_SCRIPT = """
import sys, torch
from deepspeed_cpp.ops import cpu_adam_step_multi, cpu_adagrad_step_multi, cpu_lion_step_multi
from deepspeed_cpp.ops.cpu_adam import cpu_adam_isa
from deepspeed_cpp.ops.cpu_adagrad import cpu_adagrad_isa
from deepspeed_cpp.ops.cpu_lion import cpu_lion_isa
torch.manual_seed(int(sys.argv[1]))
sizes = [1, 31, 100003]
dtypes = [(torch.float32, torch.float32, torch.float32, None),
          (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16),
          (torch.float32, torch.float16, torch.bfloat16, torch.float16),
          (torch.bfloat16, torch.bfloat16, torch.bfloat16, None),
          (torch.float16, torch.float32, torch.float32, None)]
results = {"isa": (cpu_adam_isa(), cpu_adagrad_isa(), cpu_lion_isa())}
for index, (pd, gd, sd, ld) in enumerate(dtypes):
    p = [torch.randn(n).to(pd) for n in sizes]
    g = [torch.randn(n).to(gd) for n in sizes]
    m = [torch.randn(n).to(sd) for n in sizes]
    v = [torch.rand(n).to(sd) for n in sizes]
    lo = None if ld is None else [torch.empty(n, dtype=ld) for n in sizes]
    for step in range(1, 4):
        cpu_adam_step_multi(p, g, m, v, step=step, lr=1e-3, weight_decay=0.01,
                            adamw_mode=step % 2 == 0, params_lowp=lo, grad_scale=2.0 ** step)
        results[f"adam{index}.{step}"] = [t.clone() for t in p + m + v + (lo or [])]
        cpu_adagrad_step_multi(p, g, v, step=step, lr=1e-2, weight_decay=0.1, lr_decay=0.01,
                               params_lowp=lo, grad_scale=3.0)
        results[f"adagrad{index}.{step}"] = [t.clone() for t in p + v + (lo or [])]
        cpu_lion_step_multi(p, g, m, lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1,
                            params_lowp=lo)
        results[f"lion{index}.{step}"] = [t.clone() for t in p + m + (lo or [])]
torch.save(results, sys.argv[2])
"""


def test_every_optimizer_and_dtype_bitwise_identical_across_isa_levels(tmp_path):
    seed = int(torch.randint(0, 2**31, (1,)))
    outputs = {}
    # One process per level, all started at once: each is mostly an interpreter importing torch.
    runs = {
        level: subprocess.Popen(
            [sys.executable, "-c", _ISA_SCRIPT, str(seed), str(tmp_path / f"{level}.pt")],
            env=dict(os.environ, DS_CPU_ISA=level),
        )
        for level in supported_isa_levels()
    }
    try:
        for level, run in runs.items():
            assert run.wait(timeout=600) == 0, f"the {level} run failed (its stderr is above)"
    finally:
        for run in runs.values():
            if run.poll() is None:
                run.kill()
                run.wait()
    for level in runs:
        outputs[level] = torch.load(tmp_path / f"{level}.pt", weights_only=True)
        assert outputs[level].pop("isa") == (level, level, level)
    first = outputs["scalar"]
    for level, result in outputs.items():
        for key, tensors in result.items():
            for index, (a, b) in enumerate(zip(tensors, first[key])):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (
                    f"{level} differs from scalar in {key} tensor {index}"
                )
