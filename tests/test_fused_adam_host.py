"""The fused CUDA Adam's kernel body run on the CPU (csrc/fused_adam/fused_adam_chunk.h through the
host test library): against torch's AdamW in float64, bit for bit against cpu_adam, every dtype
combination, unscaling, found_inf, device-side lr and steps, the conversions, opcheck, compile and
the argument checks. Only the CUDA launch itself is not run here (tests/test_fused_adam_cuda.py)."""

import itertools
import math

import pytest
import torch
from adam_reference import reference_adam_steps, storage_ulp

from deepspeed_cpp.ops import cpu_adam_step_multi
from deepspeed_cpp.ops.fused_adam import fused_adam, load_fused_adam_host_emulation

LOW_PRECISION = (torch.bfloat16, torch.float16)
DTYPES = (torch.float32, *LOW_PRECISION)
MODES = [
    dict(adamw_mode=adamw, bias_correction=bc, weight_decay=wd)
    for adamw, bc, wd in itertools.product([True, False], [True, False], [0.0, 0.1])
]
# Small chunks and launches, so that odd sizes split into partial chunks, tensors span launches
# and threads of a block go idle: (chunk_elements, max_tensors, max_blocks, threads_per_block).
SMALL_CAPACITY = (1000, 2, 3, 96)


@pytest.fixture(scope="module", autouse=True)
def host_library():
    load_fused_adam_host_emulation()


def host_test_ops():
    return torch.ops.deepspeed_cpp_fused_adam_test


def run_ours(params, grads, exp_avgs, exp_avg_sqs, *, capacity=None, step, lr, beta1=0.9,
             beta2=0.999, eps=1e-8, weight_decay=0.0, bias_correction=True, adamw_mode=True,
             **device_values):  # fmt: skip
    """One call of the op: the real CPU kernel (CUDA capacity), or the test op with `capacity`."""
    hyper = (step, lr, beta1, beta2, eps, weight_decay, bias_correction, adamw_mode)
    if capacity is None:
        fused_adam(params, grads, exp_avgs, exp_avg_sqs, step=step, lr=lr, beta1=beta1,
                   beta2=beta2, eps=eps, weight_decay=weight_decay,
                   bias_correction=bias_correction, adamw_mode=adamw_mode,
                   **device_values)  # fmt: skip
    else:
        host_test_ops().fused_adam_with_capacity(*capacity, params, grads, exp_avgs, exp_avg_sqs,
                                            *hyper, **device_values)  # fmt: skip


def fresh_state(shapes, param_dtype=torch.float32, state_dtype=torch.float32):
    params = [torch.randn(s).to(param_dtype) for s in shapes]
    exp_avgs = [torch.zeros(s, dtype=state_dtype) for s in shapes]
    exp_avg_sqs = [torch.zeros(s, dtype=state_dtype) for s in shapes]
    return params, exp_avgs, exp_avg_sqs


def clone_all(tensors):
    return [t.clone() for t in tensors]


@pytest.mark.parametrize("capacity", [None, SMALL_CAPACITY], ids=["cuda-capacity", "small"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()))
def test_matches_torch_float64(mode, capacity):
    shapes = [(1,), (7,), (5, 13), (4095,), (65536 + 3,)]
    steps = 20
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, **mode)
    params, exp_avgs, exp_avg_sqs = fresh_state(shapes)
    initial = clone_all(params)
    # Gradients of varied magnitude per step, so that exp_avg_sq and eps both matter.
    grads = [[torch.randn(s) * torch.empty(1).uniform_(0.01, 2) for s in shapes]
             for _ in range(steps)]  # fmt: skip
    for step, step_grads in enumerate(grads, start=1):
        run_ours(params, step_grads, exp_avgs, exp_avg_sqs, capacity=capacity, step=step, **hp)
    reference_hp = dict(lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"], **mode)
    ours, reference, fp32_reference = [], [], []
    for index, (param, start) in enumerate(zip(params, initial)):
        tensor_grads = [g[index] for g in grads]
        reference.append(reference_adam_steps(start, tensor_grads, **reference_hp).flatten())
        fp32_reference.append(reference_adam_steps(start, tensor_grads, dtype=torch.float32,
                                                   **reference_hp).flatten())  # fmt: skip
        ours.append(param.flatten())
        # Sanity bound per tensor (float32 itself reaches ~2e-5 in the first L2 steps without
        # bias correction, which divide by tiny second moments).
        assert (ours[-1].double() - reference[-1]).abs().max() <= 1e-4 * reference[-1].abs().max()
    # The tight check, over the whole list (a one-element tensor alone says little): ours may not
    # be further from float64 than torch's own float32 run is.
    ours, reference, fp32_reference = (torch.cat(ts) for ts in (ours, reference, fp32_reference))
    fp32_error = (fp32_reference.double() - reference).abs().max().item()
    error = (ours.double() - reference).abs().max().item()
    scale = reference.abs().max().item()
    # + 4 float32 ulps of the largest value: with a handful of elements torch's own error can
    # be zero by luck, which no other float32 implementation could be asked to match.
    assert error <= 1.5 * fp32_error + 4 * 2**-23 * scale, (
        f"max |ours - float64| = {error:.3e}, torch float32: {fp32_error:.3e}"
    )


@pytest.mark.parametrize(
    "mode", MODES[:4], ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items())
)
def test_float32_equals_cpu_adam_bitwise(mode):
    shapes = [(3, 5), (1,), (4095,), (17, 65), (2**17 + 1,), (0,)]
    params, exp_avgs, exp_avg_sqs = fresh_state(shapes)
    cpu_params, cpu_exp_avgs, cpu_exp_avg_sqs = map(clone_all, (params, exp_avgs, exp_avg_sqs))
    hp = dict(lr=3e-3, beta1=0.8, beta2=0.95, eps=1e-6, **mode)
    for step in (1, 2, 3):
        grads = [torch.randn(s) for s in shapes]
        run_ours(params, grads, exp_avgs, exp_avg_sqs, step=step, **hp)
        cpu_adam_step_multi(cpu_params, grads, cpu_exp_avgs, cpu_exp_avg_sqs, step=step, **hp)
    for ours, theirs in zip(params + exp_avgs + exp_avg_sqs,
                            cpu_params + cpu_exp_avgs + cpu_exp_avg_sqs):  # fmt: skip
        assert torch.equal(ours, theirs)


def test_launch_split_and_threads_do_not_change_a_bit():
    shapes = [(2**16 + 5,), (1,), (300,), (2**12,), (77, 3)]
    params, exp_avgs, exp_avg_sqs = fresh_state(shapes)
    results = []
    for capacity in (None, SMALL_CAPACITY, (5, 1, 1, 1), (64, 36, 440, 1024)):
        p, m, v = map(clone_all, (params, exp_avgs, exp_avg_sqs))
        for step in (1, 2):
            grads = [torch.full(s, 0.5 * step) + torch.arange(torch.Size(s).numel()).reshape(s)
                     * 1e-3 for s in shapes]  # fmt: skip
            run_ours(p, grads, m, v, capacity=capacity, step=step, lr=1e-2, weight_decay=0.01)
        results.append(p + m + v)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def bits(t):
    """The stored bit patterns, so that equality also holds for NaNs and signed zeros."""
    return t.reshape(-1).view(torch.int32 if t.element_size() == 4 else torch.int16)


# (param, grad, state): state is float32 or the parameters' dtype.
DTYPE_COMBINATIONS = [(p, g, s) for p in DTYPES for g in DTYPES
                      for s in dict.fromkeys((torch.float32, p))]  # fmt: skip


@pytest.mark.parametrize("param_dtype, grad_dtype, state_dtype", DTYPE_COMBINATIONS,
                         ids=lambda d: str(d).removeprefix("torch."))  # fmt: skip
def test_every_dtype_combination_is_the_float32_update_rounded(param_dtype, grad_dtype,
                                                               state_dtype):  # fmt: skip
    """Each element is loaded exactly into float32, updated by the float32 kernel and rounded to
    nearest even on store, so ours must equal the float32 op on the upcast values followed by
    torch's own Tensor.to(), bit for bit."""
    shapes = [(1000,), (3, 7), (2**12 + 3,)]
    params = [torch.randn(s).to(param_dtype) for s in shapes]
    exp_avgs = [(torch.randn(s) * 0.1).to(state_dtype) for s in shapes]
    exp_avg_sqs = [(torch.rand(s) * 0.01).to(state_dtype) for s in shapes]
    grads = [(torch.randn(s) * 0.1).to(grad_dtype) for s in shapes]
    # float32 copies, updated by the same op with everything in float32
    ref_p, ref_m, ref_v, ref_g = (
        [t.to(torch.float32, copy=True) for t in ts]
        for ts in (params, exp_avgs, exp_avg_sqs, grads)
    )
    hp = dict(step=3, lr=1e-2, weight_decay=0.05)
    run_ours(params, grads, exp_avgs, exp_avg_sqs, capacity=SMALL_CAPACITY, **hp)
    run_ours(ref_p, ref_g, ref_m, ref_v, **hp)
    assert len(DTYPE_COMBINATIONS) == 15
    for ours, reference in zip(params + exp_avgs + exp_avg_sqs, ref_p + ref_m + ref_v):
        assert torch.equal(bits(ours), bits(reference.to(ours.dtype)))


@pytest.mark.parametrize("param_dtype", LOW_PRECISION)
def test_low_precision_tracks_float64(param_dtype):
    """bf16/fp16 parameters with float32 state over many steps stay within two storage ulps of a
    float64 run whose parameter is rounded to the same dtype after every step: ulps at the largest
    magnitude the element has had, since a one-ulp difference in rounding made there is carried
    as the value moves toward zero (DS_TEST_SEED=2248758347: 3.8e-6 apart, one ulp at 0.0039,
    four at the 0.0018 the element had reached three steps later)."""
    n, steps, lr = 4097, 10, 1e-3
    param = torch.randn(n).to(param_dtype)
    exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n)
    ref_p, ref_m, ref_v = param.double(), torch.zeros(n, dtype=torch.float64), torch.zeros(
        n, dtype=torch.float64)  # fmt: skip
    path_max = ref_p.abs()  # as reference_adam_steps' return_path_max
    for step in range(1, steps + 1):
        grad = torch.randn(n).to(param_dtype)
        run_ours([param], [grad], [exp_avg], [exp_avg_sq], step=step, lr=lr, weight_decay=0.01)
        g = grad.double()
        ref_p = ref_p * (1 - lr * 0.01)
        ref_m = 0.9 * ref_m + 0.1 * g
        ref_v = 0.999 * ref_v + 0.001 * g * g
        denom = (ref_v / (1 - 0.999**step)).sqrt() + 1e-8
        ref_p = (ref_p - lr / (1 - 0.9**step) * ref_m / denom).to(param_dtype).double()
        path_max = torch.maximum(path_max, ref_p.abs())
    assert ((param.double() - ref_p).abs() <= 2 * storage_ulp(path_max, param_dtype)).all()
    assert (param.double() == ref_p).float().mean() > 0.98


def test_unscaling_by_a_power_of_two_is_exact():
    shapes = [(129,), (5, 5)]
    params, exp_avgs, exp_avg_sqs = fresh_state(shapes)
    p2, m2, v2 = map(clone_all, (params, exp_avgs, exp_avg_sqs))
    grads = [torch.randn(s) for s in shapes]
    scaled = [g * 1024 for g in grads]
    run_ours(params, scaled, exp_avgs, exp_avg_sqs, step=1, lr=1e-2,
             inv_grad_scale=torch.tensor([1 / 1024]))  # fmt: skip
    run_ours(p2, grads, m2, v2, step=1, lr=1e-2)
    for a, b in zip(params + exp_avgs + exp_avg_sqs, p2 + m2 + v2):
        assert torch.equal(a, b)


def test_unscaling_multiplies_by_the_inverse_scale():
    # Any scale: the kernel multiplies in float32, exactly as g * inv does in torch.
    shapes = [(1001,)]
    params, exp_avgs, exp_avg_sqs = fresh_state(shapes)
    p2, m2, v2 = map(clone_all, (params, exp_avgs, exp_avg_sqs))
    grads = [torch.randn(s, dtype=torch.bfloat16) for s in shapes]
    inv = torch.tensor([1 / 3000.0])
    run_ours(params, grads, exp_avgs, exp_avg_sqs, step=2, lr=1e-2, inv_grad_scale=inv)
    run_ours(p2, [g.float() * inv for g in grads], m2, v2, step=2, lr=1e-2)
    for a, b in zip(params + exp_avgs + exp_avg_sqs, p2 + m2 + v2):
        assert torch.equal(a, b)


def test_found_inf_makes_the_call_a_no_op():
    shapes = [(2**16 + 9,), (3,)]
    params, exp_avgs, exp_avg_sqs = fresh_state(shapes)
    exp_avgs = [torch.randn(s) for s in shapes]
    before = clone_all(params + exp_avgs + exp_avg_sqs)
    grads = [torch.randn(s) for s in shapes]
    grads[1][1] = float("inf")
    run_ours(params, grads, exp_avgs, exp_avg_sqs, capacity=SMALL_CAPACITY, step=1, lr=0.1,
             found_inf=torch.tensor([1.0]), inv_grad_scale=torch.tensor([0.5]))  # fmt: skip
    for a, b in zip(params + exp_avgs + exp_avg_sqs, before):
        assert torch.equal(a, b)
    grads[1][1] = 0.0
    run_ours(params, grads, exp_avgs, exp_avg_sqs, step=1, lr=0.1, found_inf=torch.tensor([0.0]))
    assert not torch.equal(params[0], before[0])


def test_device_lr_and_per_tensor_steps_equal_the_host_values():
    shapes = [(70000,), (33,), (1,)]
    tensor_steps = [1, 7, 1000]
    params, exp_avgs, exp_avg_sqs = fresh_state(shapes)
    exp_avgs = [torch.randn(s) for s in shapes]
    exp_avg_sqs = [torch.rand(s) for s in shapes]
    grads = [torch.randn(s) for s in shapes]
    p2, m2, v2 = map(clone_all, (params, exp_avgs, exp_avg_sqs))
    hp = dict(lr=3e-3, beta1=0.85, beta2=0.98, weight_decay=0.1)
    run_ours(params, grads, exp_avgs, exp_avg_sqs, capacity=SMALL_CAPACITY, step=1,
             **dict(hp, lr=0.5), lr_tensor=torch.tensor([hp["lr"]], dtype=torch.float32),
             state_steps=[torch.tensor([float(s)]) for s in tensor_steps])  # fmt: skip
    # The host path with the float32-rounded lr the kernel read, one tensor and step at a time.
    host_lr = float(torch.tensor(hp["lr"], dtype=torch.float32))
    for i, step in enumerate(tensor_steps):
        run_ours([p2[i]], [grads[i]], [m2[i]], [v2[i]], step=step, **dict(hp, lr=host_lr))
    for a, b in zip(params + exp_avgs + exp_avg_sqs, p2 + m2 + v2):
        assert torch.equal(a, b)


def _coefficients_in_float64(
    lr, step, beta1, beta2, eps, weight_decay, bias_correction, adamw_mode
):
    """AdamCoefficients' fields (csrc/common/adam_math.h) folded in float64 by Python."""
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    l2_decay = 0.0 if adamw_mode else weight_decay
    decay_factor = 1.0 - lr * weight_decay if adamw_mode else 1.0
    return [beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps, l2_decay, decay_factor, -lr / bc1,
            1.0 / math.sqrt(bc2)]  # fmt: skip


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()))
def test_device_coefficients_equal_a_float64_reference_bitwise(mode):
    """The coefficients the kernel derives from device-side lr and steps are the float64
    expressions rounded once to float32."""
    n = 2000
    lrs = torch.rand(n, dtype=torch.float64) * torch.logspace(-6, 0, n, dtype=torch.float64)
    steps = torch.randint(1, 10**6, (n,))
    steps[:20] = torch.arange(1, 21)
    betas = torch.rand(2, dtype=torch.float64) * 0.2 + 0.79
    hyper = (float(betas[0]), float(betas[1]), 1e-8, mode["weight_decay"],
             mode["bias_correction"], mode["adamw_mode"])  # fmt: skip
    ours = host_test_ops().coefficients(lrs, steps, *hyper)
    reference = torch.tensor(
        [_coefficients_in_float64(float(lr), int(step), *hyper) for lr, step in zip(lrs, steps)],
        dtype=torch.float64,
    ).float()
    assert torch.equal(ours.view(torch.int32), reference.view(torch.int32))


def interesting_floats(count):
    """Random bit patterns (every class: zero, subnormal, normal, inf, NaN) plus the edges of the
    float16/bfloat16 ranges and exact ties."""
    bits = torch.randint(-(2**31), 2**31, (count,), dtype=torch.int64).to(torch.int32)
    values = [bits.view(torch.float32)]
    edges = [0.0, -0.0, 65504.0, 65519.99, 65520.0, 65536.0, 2**-14, 2**-24, 2**-25, 3 * 2**-26,
             2**-25 * 1.0000001, 6.1e-5, 1e-40, float("inf"), -float("inf"), float("nan"),
             3.4e38, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-11, 1.0 + 3 * 2**-11]  # fmt: skip
    values.append(torch.tensor(edges + [-e for e in edges]))
    # values just around float16's and bfloat16's rounding points
    values.append(torch.randn(count).to(torch.float16).float().nextafter(torch.tensor(0.0)))
    values.append(torch.randn(count).to(torch.bfloat16).float() * (1 + 2**-9))
    values.append(torch.rand(count) * 2**-14)  # float16 subnormals
    return torch.cat(values)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_conversions_equal_torch_bitwise(dtype):
    values = interesting_floats(200_000)
    ours = host_test_ops().to_low_precision(values, dtype == torch.bfloat16)
    assert torch.equal(ours.view(torch.int16), values.to(dtype).view(torch.int16))
    every_pattern = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    back = host_test_ops().to_float(every_pattern)
    assert torch.equal(back.view(torch.int32), every_pattern.float().view(torch.int32))


def opcheck_samples():
    sizes = [37, 5, 1, 0]
    yield ([torch.randn(s) for s in sizes], [torch.randn(s) for s in sizes],
           [torch.randn(s) for s in sizes], [torch.rand(s) for s in sizes],
           3, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, True), {}  # fmt: skip
    yield ([torch.randn(s, dtype=torch.bfloat16) for s in sizes],
           [torch.randn(s, dtype=torch.float16) for s in sizes],
           [torch.randn(s) for s in sizes], [torch.rand(s) for s in sizes],
           1, 1e-2, 0.8, 0.9, 1e-6, 0.0, False, False), dict(
        lr_tensor=torch.tensor([0.01]), state_steps=[torch.tensor([2.0]) for _ in sizes],
        inv_grad_scale=torch.tensor([0.25]), found_inf=torch.tensor([0.0]))  # fmt: skip


def test_opcheck():
    for args, kwargs in opcheck_samples():
        torch.library.opcheck(torch.ops.deepspeed_cpp.fused_adam.default, args, kwargs)


def test_torch_compile_fullgraph():
    @torch.compile(fullgraph=True, backend="aot_eager")
    def compiled_step(p, g, m, v):
        fused_adam([p], [g * 2], [m], [v], step=1, lr=1e-2)
        return p.sum()

    p, g = torch.randn(65), torch.randn(65)
    p_ref, m_ref, v_ref = p.clone(), torch.zeros(65), torch.zeros(65)
    fused_adam([p_ref], [g * 2], [m_ref], [v_ref], step=1, lr=1e-2)
    m, v = torch.zeros(65), torch.zeros(65)
    total = compiled_step(p, g, m, v)
    assert torch.equal(p, p_ref) and torch.equal(m, m_ref) and torch.equal(v, v_ref)
    assert torch.allclose(total, p_ref.sum())


def test_empty_lists_and_empty_tensors():
    fused_adam([], [], [], [], step=1, lr=1e-3)
    p, m, v = torch.empty(0), torch.empty(0), torch.empty(0)
    fused_adam([p], [torch.empty(0)], [m], [v], step=1, lr=1e-3)


def bad_call(**overrides):
    n = 8
    args = dict(params=[torch.randn(n), torch.randn(3)], grads=[torch.randn(n), torch.randn(3)],
                exp_avgs=[torch.zeros(n), torch.zeros(3)],
                exp_avg_sqs=[torch.zeros(n), torch.zeros(3)], step=1, lr=1e-3)  # fmt: skip
    args.update(overrides)
    fused_adam(**args)


def _strided(n):
    return torch.zeros(n, 2)[:, 0]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(grads=[torch.randn(8)]), "four lists must have equal lengths, got params=2, grads=1"),
        (dict(grads=[torch.randn(8), torch.randn(4)]), "grads[1] has 4 elements (shape [4]) but "
                                                       "params[1] has 3"),
        (dict(params=[torch.randn(8).double(), torch.randn(3).double()]),
         "params[0] must be float32, bfloat16 or float16, got dtype Double"),
        (dict(params=[torch.randn(8), torch.randn(3).half()]),
         "params[1] has dtype Half but params[0] has Float; one call takes one dtype per list"),
        (dict(exp_avg_sqs=[torch.zeros(8), torch.zeros(3).bfloat16()]),
         "exp_avg_sqs[1] has dtype BFloat16 but exp_avgs[0] has Float"),
        (dict(params=[torch.randn(8).half(), torch.randn(3).half()],
              exp_avgs=[torch.zeros(8).bfloat16(), torch.zeros(3).bfloat16()],
              exp_avg_sqs=[torch.zeros(8).bfloat16(), torch.zeros(3).bfloat16()]),
         "exp_avgs[0] must be float32 or the parameters' dtype Half, got dtype BFloat16"),
        (dict(exp_avgs=[torch.zeros(8), _strided(3)]), "exp_avgs[1] must be contiguous, got "
                                                       "strides [2]"),
        (dict(step=0), "step must be >= 1 (the step number after this update), got 0"),
        (dict(lr=-1.0), "lr must be >= 0, got -1"),
        (dict(beta1=1.0), "beta1 must be in [0, 1), got 1"),
        (dict(beta2=-0.5), "beta2 must be in [0, 1), got -0.5"),
        (dict(eps=-1.0), "eps must be >= 0, got -1"),
        (dict(weight_decay=-0.1), "weight_decay must be >= 0, got -0.1"),
        (dict(lr_tensor=torch.tensor([0.1, 0.2])), "lr_tensor must have exactly one element, "
                                                   "got 2"),
        (dict(found_inf=torch.tensor([1.0], dtype=torch.float64)),
         "found_inf must be float32, got dtype Double"),
        (dict(inv_grad_scale=torch.tensor([1], dtype=torch.int32)),
         "inv_grad_scale must be float32, got dtype Int"),
        (dict(state_steps=[torch.tensor([1.0])]), "state_steps must have one tensor per "
                                                  "parameter, got 1 for 2 parameters"),
        (dict(state_steps=[torch.tensor([1.0]), torch.tensor([[1.0, 2.0]])]),
         "state_steps[1] must have exactly one element, got 2 (shape [1, 2])"),
    ],
)  # fmt: skip
def test_bad_input_names_argument_value_and_expectation(overrides, message):
    with pytest.raises(RuntimeError) as error:
        bad_call(**overrides)
    assert message in str(error.value)


def test_mixed_devices_are_named():
    with pytest.raises(ValueError, match=r"grads\[1\] is on meta but params\[0\] is on cpu"):
        bad_call(grads=[torch.randn(8), torch.randn(3, device="meta")])


def test_state_steps_replace_the_host_step():
    # step=0 is invalid on its own but is not used when state_steps are given.
    p, g, m, v = torch.randn(9), torch.randn(9), torch.zeros(9), torch.zeros(9)
    fused_adam([p], [g], [m], [v], step=0, lr=1e-3, state_steps=[torch.tensor([1.0])])
    assert m.abs().sum() > 0
