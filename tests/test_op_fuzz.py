"""Property-based argument fuzzing of the CPU ops (hypothesis): the op matches a torch
reference, or raises RuntimeError/ValueError naming an argument it was given wrong; never a
crash, never a silently wrong result.

Each example draws, per tensor argument, a dtype (supported or not), a layout (contiguous,
strided, transposed, stride-0 expanded, zero-size), a length that may disagree with the others,
aliasing between param and grad, list lengths that may disagree, and hyper-parameters from
ordinary values, zero, negative, NaN and inf. What a case *must* do follows from what was drawn:
an impossible request (unsupported dtype, mismatched lengths, a written tensor whose elements
overlap) must raise; anything else may raise (naming the argument) or must equal the reference.

The ops run in-process: a crash would end pytest, which is the loudest possible failure.
CI runs a fixed, derandomized sample (DS_OP_FUZZ_EXAMPLES to change how many,
HYPOTHESIS_PROFILE=thorough for a long random search; see fuzz_settings.py). Bucket planning and
MoE gating: test_op_fuzz_plans_gating.py.
"""

from __future__ import annotations

import math
import re

import torch
from fuzz_settings import FUZZ  # skips the module without hypothesis
from hypothesis import given
from hypothesis import strategies as st

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32]
LAYOUTS = ["contiguous", "strided", "transposed", "expanded", "empty"]
HYPER = st.sampled_from([0.1, 1e-3, 0.0, -0.5, math.nan, math.inf, -math.inf])
PARAM_DTYPES = {torch.float32, torch.bfloat16, torch.float16}
STATE_DTYPES = {torch.float32, torch.bfloat16}


def _tensor(numel: int, dtype, layout: str, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(2 * max(numel, 1) + 2, generator=generator)
    if layout == "empty":
        return torch.empty(0, dtype=dtype)
    if layout == "strided":
        return values[: 2 * numel : 2].to(dtype) if dtype != torch.int32 else values[:numel:1].int()
    if layout == "transposed" and numel % 2 == 0 and numel >= 4:
        return values[:numel].to(dtype).reshape(2, numel // 2).t()
    if layout == "expanded" and numel > 1:
        return values[:1].to(dtype).expand(numel)
    return values[:numel].to(dtype) if dtype != torch.int32 else (values[:numel] * 10).int()


def _overlaps(t: torch.Tensor) -> bool:
    return t.numel() > 1 and any(s == 0 for s, n in zip(t.stride(), t.shape) if n > 1)


@st.composite
def optimizer_case(draw, names, hyper_defaults):
    """Tensors ``names`` (param, grad, then the optimizer states) and hyper-parameters."""
    numel = draw(st.integers(1, 40))
    case, must_fail, suspects = {}, [], []
    for index, name in enumerate(names):
        dtype = draw(st.sampled_from(DTYPES if draw(st.booleans()) else [torch.float32]))
        layout = draw(st.sampled_from(LAYOUTS if draw(st.booleans()) else ["contiguous"]))
        length = numel + draw(st.sampled_from([0, 0, 0, 1, -1]))
        tensor = _tensor(max(length, 0), dtype, layout, seed=index)
        if name not in ("param", "grad") and tensor.numel():
            # state starts at zero (the reference's first step); an expanded view stays expanded
            overlapping = _overlaps(tensor)
            tensor = (
                torch.zeros(1, dtype=dtype).expand(tensor.shape) if overlapping else tensor.zero_()
            )
        case[name] = tensor
        allowed = PARAM_DTYPES if name in ("param", "grad") else STATE_DTYPES
        if dtype not in allowed:
            must_fail.append(name)
        if name != "grad" and _overlaps(tensor):
            must_fail.append(name)  # a written tensor whose elements share memory
        if not tensor.is_contiguous() or tensor.numel() == 0:
            suspects.append(name)
    mismatched = [n for n in names if case[n].numel() != case["param"].numel()]
    must_fail += mismatched + (["param"] if mismatched else [])
    states = [case[n] for n in names[2:]]
    if len({t.dtype for t in states}) > 1:
        must_fail += names[2:]  # the optimizer states share one dtype
    if draw(st.integers(0, 5)) == 0 and not {"param", "grad"} & set(must_fail):
        case["grad"] = case["param"]  # aliasing: the gradient is the parameter itself
        suspects.append("grad")
    hyper = {
        name: draw(HYPER if draw(st.integers(0, 3)) == 0 else st.just(default))
        for name, default in hyper_defaults.items()
    }
    suspects += [n for n, v in hyper.items() if not (math.isfinite(v) and v > 0)]
    return case, hyper, must_fail, suspects


def _names_one(message: str, names) -> bool:
    return any(re.search(rf"\b{re.escape(n)}s?\b", message) for n in names)


def _judge(run, reference, case, must_fail, suspects):
    """Runs the op on the drawn tensors; asserts the outcome is one the case allows."""
    before = {
        k: v.detach().double().clone() for k, v in case.items()
    }  # grad aliasing param: pre-step
    try:
        run(**case)
    except (RuntimeError, ValueError) as error:
        message = str(error)
        assert must_fail or suspects, f"a valid case was refused: {message}"
        assert _names_one(message, must_fail + suspects), (message, must_fail, suspects)
        return
    assert not must_fail, f"accepted although {must_fail} are wrong: {_describe(case)}"
    expected = reference(**before)
    got = case["param"].double()
    tolerance = 1e-5 if case["param"].dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance, equal_nan=True)


def _describe(case) -> str:
    return ", ".join(
        f"{k}: {v.dtype} {tuple(v.shape)} strides {v.stride()}" for k, v in case.items()
    )


ADAM = ["param", "grad", "exp_avg", "exp_avg_sq"]
ADAM_HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
LION_HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.0}
ADAGRAD_HYPER = {"lr": 1e-2, "eps": 1e-10, "weight_decay": 0.0, "lr_decay": 0.0}


# --- Adam ---------------------------------------------------------------------------------------
@FUZZ
@given(optimizer_case(ADAM, ADAM_HYPER), st.booleans())
def test_cpu_adam_step_fuzz(drawn, adamw_mode):
    from deepspeed_cpp.ops import cpu_adam_step

    case, hyper, must_fail, suspects = drawn

    def run(param, grad, exp_avg, exp_avg_sq):
        cpu_adam_step(param, grad, exp_avg, exp_avg_sq, step=1, adamw_mode=adamw_mode, **hyper)

    def reference(param, grad, exp_avg, exp_avg_sq):
        lr, b1, b2, eps, wd = (hyper[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay"))
        p, g = param.clone(), grad.clone()
        if adamw_mode:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
        m, v = (1 - b1) * g, (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1), v / (1 - b2)
        return p - lr * m_hat / (v_hat.sqrt() + eps)

    _judge(run, reference, case, must_fail, suspects)


@FUZZ
@given(optimizer_case(["param", "grad", "exp_avg"], LION_HYPER))
def test_cpu_lion_step_fuzz(drawn):
    from deepspeed_cpp.ops import cpu_lion_step

    case, hyper, must_fail, suspects = drawn

    def run(param, grad, exp_avg):
        cpu_lion_step(param, grad, exp_avg, **hyper)

    def reference(param, grad, exp_avg):
        lr, b1, wd = hyper["lr"], hyper["beta1"], hyper["weight_decay"]
        return param * (1 - lr * wd) - lr * torch.sign((1 - b1) * grad)

    _judge(run, reference, case, must_fail, suspects)


@FUZZ
@given(optimizer_case(["param", "grad", "state_sum"], ADAGRAD_HYPER))
def test_cpu_adagrad_step_fuzz(drawn):
    from deepspeed_cpp.ops import cpu_adagrad_step

    case, hyper, must_fail, suspects = drawn

    def run(param, grad, state_sum):
        cpu_adagrad_step(param, grad, state_sum, step=1, **hyper)

    def reference(param, grad, state_sum):
        g = grad + hyper["weight_decay"] * param
        clr = hyper["lr"] / (1 + 0.0 * hyper["lr_decay"])  # torch's: inf lr_decay gives NaN
        return param - clr * g / ((g * g).sqrt() + hyper["eps"])

    _judge(run, reference, case, must_fail, suspects)


@FUZZ
@given(st.lists(st.integers(0, 3), min_size=4, max_size=4), st.integers(1, 12))
def test_cpu_adam_step_multi_list_lengths(lengths, numel):
    """Lists of unequal length are refused naming them; equal lists step every tensor."""
    from deepspeed_cpp.ops import cpu_adam_step_multi

    lists = [[_tensor(numel, torch.float32, "contiguous", seed=i + 10 * k) for i in range(n)]
             for k, n in enumerate(lengths)]  # fmt: skip
    for state in lists[2:]:
        for t in state:
            t.zero_()
    before = [p.clone() for p in lists[0]]
    try:
        cpu_adam_step_multi(*lists, step=1, lr=1e-3)
    except (RuntimeError, ValueError) as error:
        assert len(set(lengths)) > 1, f"equal lists refused: {error}"
        assert _names_one(str(error), ["params", "grads", "exp_avgs", "exp_avg_sqs"]), str(error)
        return
    assert len(set(lengths)) == 1, f"lists of lengths {lengths} accepted"
    for p, p0, g in zip(lists[0], before, lists[1]):
        # first Adam step, no decay: -lr * g / (|g| + eps') element-wise, ~ -lr * sign(g)
        expected = p0.double() - 1e-3 * g.double() / (g.double().abs() + 1e-8)
        torch.testing.assert_close(p.double(), expected, rtol=1e-5, atol=1e-6)


# --- ZeRO flatten / unflatten ---------------------------------------------------------------------
@st.composite
def flatten_case(draw):
    count = draw(st.integers(0, 4))
    tensors, suspects, must_fail = [], [], []
    for index in range(count):
        numel = draw(st.integers(0, 12))
        dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
        layout = draw(st.sampled_from(["contiguous", "contiguous", "strided", "transposed"]))
        tensors.append(_tensor(numel, dtype, layout, seed=index))
    sizes = [t.numel() for t in tensors]
    offsets = list(itertools_accumulate([0] + sizes[:-1])) if sizes else []
    if draw(st.integers(0, 3)) == 0 and offsets:
        offsets[draw(st.integers(0, len(offsets) - 1))] += draw(st.sampled_from([-100, -1, 1, 50]))
    if draw(st.integers(0, 5)) == 0:
        offsets = offsets + [0] if draw(st.booleans()) or not offsets else offsets[:-1]
        must_fail.append("offsets")
    capacity = sum(sizes) + draw(st.sampled_from([0, 0, 3, -1]))
    flat_layout = draw(st.sampled_from(["contiguous", "contiguous", "strided", "expanded"]))
    flat = _tensor(max(capacity, 0), draw(st.sampled_from([torch.float32, torch.float16])),
                   flat_layout, seed=99)  # fmt: skip
    if flat_layout != "contiguous":
        suspects.append("flat")
    if "offsets" not in must_fail:
        for offset, size in zip(offsets, sizes):
            if offset < 0 or offset + size > flat.numel():
                must_fail.append("offsets")
                break
    return tensors, flat, offsets, must_fail, suspects


def itertools_accumulate(values):
    total = 0
    for value in values:
        total += value
        yield total


def _flatten_reference(tensors, flat, offsets):
    out = flat.clone()
    for tensor, offset in zip(tensors, offsets):
        out[offset : offset + tensor.numel()] = tensor.reshape(-1).to(out.dtype)
    return out


@FUZZ
@given(flatten_case())
def test_zero_flatten_into_fuzz(drawn):
    from deepspeed_cpp.ops.zero import flatten_into

    tensors, flat, offsets, must_fail, suspects = drawn
    if "flat" in suspects and _overlaps(flat):
        must_fail = must_fail + ["flat"]  # writing into elements that share memory
    expected = None if must_fail else _flatten_reference(tensors, flat.clone(), offsets)
    try:
        flatten_into(tensors, flat, offsets)
    except (RuntimeError, ValueError) as error:
        assert must_fail or suspects, f"a valid case was refused: {error}"
        assert _names_one(str(error), must_fail + suspects + ["tensors", "offsets"]), str(error)
        return
    assert not must_fail, f"accepted although {must_fail} are wrong"
    torch.testing.assert_close(flat, expected, rtol=0, atol=0)


@FUZZ
@given(flatten_case())
def test_zero_unflatten_from_fuzz(drawn):
    from deepspeed_cpp.ops.zero import unflatten_from

    tensors, flat, offsets, must_fail, suspects = drawn
    must_fail = [n for n in must_fail if n != "flat"]  # flat is only read here
    expected = [
        flat.reshape(-1)[o : o + t.numel()].to(t.dtype).reshape(t.shape)
        for t, o in zip(tensors, offsets)
    ] if not must_fail else None  # fmt: skip
    try:
        unflatten_from(flat, tensors, offsets)
    except (RuntimeError, ValueError) as error:
        assert must_fail or suspects or any(not t.is_contiguous() for t in tensors), str(error)
        assert _names_one(str(error), must_fail + suspects + ["tensors", "offsets"]), str(error)
        return
    assert not must_fail, f"accepted although {must_fail} are wrong"
    for tensor, want in zip(tensors, expected):
        torch.testing.assert_close(tensor, want, rtol=0, atol=0)


# --- Adam's host-side options: param_lowp, grad_scale, found_inf -------------------------------
LOWP_DTYPES = [torch.bfloat16, torch.float16]
GRAD_SCALES = [1.0, 1024.0, 3.0, 0.5, 1e-39, 1e38, 0.0, -2.0, math.nan, math.inf, 1e-46, 1e46]


def _grad_scale_valid(scale: float) -> bool:
    if not (math.isfinite(scale) and scale > 0):
        return False
    reciprocal = float(torch.tensor(1.0 / scale, dtype=torch.float32))
    return math.isfinite(reciprocal) and reciprocal > 0


@st.composite
def adam_options_case(draw):
    """A float32 param with Adam state and the optional arguments, some of them wrong."""
    numel = draw(st.integers(0, 40))
    seed = draw(st.integers(0, 1000))
    generator = torch.Generator().manual_seed(seed)
    param = torch.randn(numel, generator=generator)
    grad = torch.randn(numel, generator=generator) * draw(st.sampled_from([1.0, 1e3, 1e-3]))
    if numel and draw(st.integers(0, 3)) == 0:  # a non-finite or huge gradient element
        grad[draw(st.integers(0, numel - 1))] = draw(st.sampled_from([math.inf, math.nan, 3e38]))
    grad = grad.to(draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])))
    case = {"param": param, "grad": grad, "exp_avg": torch.randn(numel, generator=generator),
            "exp_avg_sq": torch.rand(numel, generator=generator) ** 2}  # fmt: skip
    must_fail = []
    lowp = draw(st.sampled_from(["none", "bf16", "fp16", "fp16", "float32", "short", "strided",
                                 "aliases_param"]))  # fmt: skip
    if lowp in ("bf16", "fp16"):
        case["param_lowp"] = torch.full((numel,), 7.0, dtype=LOWP_DTYPES[lowp == "fp16"])
    elif lowp == "float32":
        case["param_lowp"], must_fail = torch.zeros(numel), must_fail + ["param_lowp"]
    elif lowp == "short":
        case["param_lowp"] = torch.zeros(numel + 1, dtype=torch.bfloat16)
        must_fail.append("param_lowp")
    elif lowp == "strided" and numel > 1:
        case["param_lowp"] = torch.zeros(2 * numel, dtype=torch.bfloat16)[::2]
        must_fail.append("param_lowp")
    elif lowp == "aliases_param" and numel > 1:
        case["param_lowp"] = param.view(torch.bfloat16)[:numel]  # the master's own bytes
        must_fail.append("param_lowp")
    scale = draw(st.sampled_from(GRAD_SCALES))
    if not _grad_scale_valid(scale):
        must_fail.append("grad_scale")
    flag = draw(st.sampled_from(["none", "zero", "zero", "set", "float64", "two"]))
    if flag != "none":
        dtype = torch.float64 if flag == "float64" else torch.float32
        flag_tensor = torch.zeros(2 if flag == "two" else 1, dtype=dtype)
        flag_tensor[0] = 1.0 if flag == "set" else 0.0
        case["found_inf"] = flag_tensor
        if flag in ("float64", "two"):
            must_fail.append("found_inf")
    hyper = {"step": draw(st.integers(1, 4)), "adamw_mode": draw(st.booleans()),
             "weight_decay": draw(st.sampled_from([0.0, 0.01])), "lr": 1e-3}  # fmt: skip
    return case, scale, hyper, must_fail


def _adam_options_reference(case, scale, hyper):
    """The documented semantics, in float64 but for the float32 unscaling (gradient times
    float32(1 / grad_scale), checked for non-finite values there)."""
    out = {k: v.detach().clone() for k, v in case.items()}
    flag = out.get("found_inf")
    if flag is not None and flag[0] != 0:
        return out  # an earlier check found an overflow: nothing happens
    multiplier = torch.tensor(1.0 / scale, dtype=torch.float32)
    unscaled = case["grad"].float() * multiplier
    if flag is not None:
        flag[0] = 0.0 if bool(unscaled.isfinite().all()) else 1.0
        if flag[0] != 0:
            return out
    lr, wd, step = hyper["lr"], float(torch.tensor(hyper["weight_decay"]).float()), hyper["step"]
    b1, b2, eps = 0.9, 0.999, 1e-8
    p, g = case["param"].double(), unscaled.double()
    if hyper["adamw_mode"]:
        p = p * (1 - lr * wd)
    else:
        g = g + wd * p
    # The moments are stored in float32: a gradient whose square overflows float32 makes
    # exp_avg_sq inf (and the step 0), as torch's own float32 Adam does.
    m = (b1 * case["exp_avg"].double() + (1 - b1) * g).float().double()
    v = (b2 * case["exp_avg_sq"].double() + (1 - b2) * g * g).float().double()
    p = p - lr * (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps)
    out["param"], out["exp_avg"], out["exp_avg_sq"] = p, m, v
    return out


@FUZZ
@given(adam_options_case())
def test_cpu_adam_options_fuzz(drawn):
    """param_lowp, grad_scale and found_inf: the documented result, or an error naming them."""
    from deepspeed_cpp.ops import cpu_adam_step

    case, scale, hyper, must_fail = drawn
    expected = None if must_fail else _adam_options_reference(case, scale, hyper)
    before = {k: v.clone() for k, v in case.items()}
    try:
        cpu_adam_step(case["param"], case["grad"], case["exp_avg"], case["exp_avg_sq"],
                      param_lowp=case.get("param_lowp"), grad_scale=scale,
                      found_inf=case.get("found_inf"), **hyper)  # fmt: skip
    except (RuntimeError, ValueError) as error:
        assert must_fail, f"a valid case was refused: {error}"
        assert _names_one(str(error), must_fail), (str(error), must_fail)
        for name, value in before.items():  # a refused call writes nothing
            assert torch.equal(case[name], value) or value.isnan().any(), name
        return
    assert not must_fail, f"accepted although {must_fail} are wrong"
    for name in ("param", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(case[name].double(), expected[name].double(), rtol=2e-5,
                                   atol=1e-6, equal_nan=True, msg=name)  # fmt: skip
    if "found_inf" in case:
        assert torch.equal(case["found_inf"], expected["found_inf"])
    if "param_lowp" in case:
        stepped = not torch.equal(case["param"], before["param"]) or case["param"].numel() == 0
        want = case["param"].to(case["param_lowp"].dtype) if stepped else before["param_lowp"]
        # the copy is the updated float32 master rounded once: exactly torch's rounding
        assert torch.equal(case["param_lowp"], want) or (
            case["param_lowp"].isnan().equal(want.isnan())
        ), (case["param_lowp"], want)


@FUZZ
@given(st.integers(1, 9), st.sampled_from(["distinct", "same_param", "same_lowp", "grad_is_m"]))
def test_cpu_adam_multi_refuses_shared_memory_between_entries(numel, sharing):
    """One tensor in two places of the lists would be updated twice or read after written."""
    from deepspeed_cpp.ops import cpu_adam_step_multi

    params = [torch.randn(numel) for _ in range(2)]
    grads = [torch.randn(numel) for _ in range(2)]
    exp_avgs = [torch.zeros(numel) for _ in range(2)]
    exp_avg_sqs = [torch.zeros(numel) for _ in range(2)]
    lowp = [torch.zeros(numel, dtype=torch.bfloat16) for _ in range(2)]
    if sharing == "same_param":
        params[1] = params[0]
    elif sharing == "same_lowp":
        lowp[1] = lowp[0]
    elif sharing == "grad_is_m":
        grads[0] = exp_avgs[1]
    expected = [p.clone() - 1e-3 * torch.sign(g) for p, g in zip(params, grads)]
    try:
        cpu_adam_step_multi(params, grads, exp_avgs, exp_avg_sqs, step=1, lr=1e-3,
                            params_lowp=lowp)  # fmt: skip
    except RuntimeError as error:
        assert sharing != "distinct", str(error)
        assert "share memory" in str(error), str(error)
        names = {"same_param": ("param[0]", "param[1]"), "same_lowp": ("param_lowp[0]",
                 "param_lowp[1]"), "grad_is_m": ("grad[0]", "exp_avg[1]")}[sharing]  # fmt: skip
        assert all(name in str(error) for name in names), str(error)
        return
    assert sharing == "distinct", f"{sharing} accepted"
    for p, want, low in zip(params, expected, lowp):
        torch.testing.assert_close(p, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(low, p.to(torch.bfloat16))
