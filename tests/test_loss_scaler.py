"""fp16 loss scalers against hand-simulated trajectories; the inf/nan check against isfinite."""

import copy
from types import SimpleNamespace

import pytest
import torch

from deepspeed_cpp.runtime.loss_scaler import (
    FP16_DEFAULTS,
    DynamicLossScaler,
    LossScaleAtMinimumError,
    StaticLossScaler,
    found_inf_or_nan,
    has_inf_or_nan,
    make_loss_scaler,
)

X, C = True, False  # an overflowing (X) step, a clean (C) step


def simulate(events, init, factor, window, min_scale, hysteresis, consecutive):
    """An independent model of DeepSpeed's rules, counting the clean streak directly.

    The scale grows on the clean step that ends a streak of ``window + 1``, ``2 window + 1``,
    ... clean steps (DeepSpeed measures ``cur_iter - last_overflow_iter - 1``); an overflow
    spends one unit of hysteresis while more than one is left, else shrinks the scale.
    """
    scale, left, streak, trajectory = init, hysteresis, 0, []
    for overflow in events:
        if overflow:
            streak = 0
            if left > 1:
                left -= 1
            else:
                scale = max(scale / factor, min_scale)
        else:
            streak += 1
            if consecutive:
                left = hysteresis
            if streak > 1 and (streak - 1) % window == 0:
                scale *= factor
                left = hysteresis
        trajectory.append(scale)
    return trajectory


def run(scaler, events):
    trajectory = []
    for overflow in events:
        scaler.update_scale(overflow)
        trajectory.append(scaler.loss_scale)
    return trajectory


# ---- hand-computed trajectories --------------------------------------------------------------


def test_window_growth_by_hand():
    scaler = DynamicLossScaler(init_scale=8.0, scale_window=2, min_scale=1.0)
    # Growth needs stable = cur_iter - last_overflow_iter - 1 to be a positive multiple of 2.
    assert run(scaler, [C, C, C, X, C, C, C, C, C]) == [8, 8, 16, 8, 8, 8, 16, 16, 32]
    assert scaler.cur_iter == 9 and scaler.last_overflow_iter == 3


def test_min_scale_floor_by_hand():
    scaler = DynamicLossScaler(
        init_scale=16.0, scale_window=100, min_scale=3.0, raise_error_at_min_scale=False
    )
    assert run(scaler, [X, X, X, X, C]) == [8, 4, 3, 3, 3]


def test_overflow_at_min_scale_raises_by_default():
    scaler = DynamicLossScaler(init_scale=4.0, scale_window=10, min_scale=1.0)
    assert run(scaler, [X, X]) == [2, 1]
    with pytest.raises(LossScaleAtMinimumError, match="already at min_scale=1.0"):
        scaler.update_scale(True)


def test_hysteresis_without_consecutive_refills_only_on_growth():
    scaler = DynamicLossScaler(init_scale=64.0, scale_window=3, delayed_shift=3)
    # Two tolerated overflows (3 -> 2 -> 1); clean steps in between do not refill.
    events = [X, C, X, C, X, X, C, C, C, C, X, X, X]
    expected = [64, 64, 64, 64, 32, 16, 16, 16, 16, 32, 32, 32, 16]
    assert run(scaler, events) == expected
    assert scaler.cur_hysteresis == 1


def test_consecutive_hysteresis_needs_back_to_back_overflows():
    scaler = DynamicLossScaler(
        init_scale=64.0, scale_window=50, delayed_shift=3, consecutive_hysteresis=True
    )
    events = [X, C, X, X, C, X, X, C, X, X, X, X]
    expected = [64, 64, 64, 64, 64, 64, 64, 64, 64, 64, 32, 16]
    assert run(scaler, events) == expected


# ---- random sequences against the model ------------------------------------------------------


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("window", [1, 3, 7])
def test_random_sequences_match_the_model(hysteresis, consecutive, window):
    events = (torch.rand(600) < 0.15 + 0.5 * torch.rand(())).tolist()
    settings = dict(init=2.0**10, factor=3.0, window=window, min_scale=0.5, hysteresis=hysteresis)
    scaler = DynamicLossScaler(
        init_scale=settings["init"],
        scale_factor=settings["factor"],
        scale_window=window,
        min_scale=settings["min_scale"],
        delayed_shift=hysteresis,
        consecutive_hysteresis=consecutive,
        raise_error_at_min_scale=False,
    )
    assert run(scaler, events) == simulate(events, consecutive=consecutive, **settings)


def test_state_dict_round_trip_continues_the_trajectory():
    events = (torch.rand(400) < 0.3).tolist()
    kwargs = dict(
        init_scale=2.0**20, scale_window=5, delayed_shift=2, raise_error_at_min_scale=False
    )
    scaler = DynamicLossScaler(**kwargs)
    run(scaler, events[:173])
    state = copy.deepcopy(scaler.state_dict())
    assert set(state) == {"cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis"}
    resumed = DynamicLossScaler(**kwargs)
    resumed.load_state_dict(state)
    assert run(resumed, events[173:]) == run(scaler, events[173:])
    assert resumed.state_dict() == scaler.state_dict()


def test_static_scaler_never_changes():
    scale = float(torch.rand(()) * 1000 + 1)
    scaler = StaticLossScaler(scale)
    assert run(scaler, (torch.rand(50) < 0.5).tolist()) == [scale] * 50
    assert scaler.dynamic is False and DynamicLossScaler().dynamic is True
    loss = torch.randn(())
    torch.testing.assert_close(scaler.scale_loss(loss), loss * scale, rtol=0, atol=0)
    restored = StaticLossScaler(1.0)
    restored.load_state_dict(scaler.state_dict())
    assert restored.loss_scale == scale


def test_dynamic_scaler_finds_the_largest_safe_power_of_two_on_a_real_fp16_model():
    # fp16 layer, the loss scaled until its gradients overflow, as a training step would do.
    layer = torch.nn.Linear(33, 7).half()
    x = torch.randn(5, 33).half()
    scaler = DynamicLossScaler(init_scale=2.0**24, scale_window=1000)
    overflows = 0
    while True:
        layer.zero_grad()
        scaler.scale_loss(layer(x).float().pow(2).sum()).backward()
        grads = [p.grad for p in layer.parameters()]
        overflow = has_inf_or_nan(grads)
        assert overflow == (not all(torch.isfinite(g).all() for g in grads))
        scaler.update_scale(overflow)
        if not overflow:
            break
        overflows += 1
    assert overflows > 0 and scaler.loss_scale == 2.0**24 / 2**overflows
    # One step up from the scale found overflows: it is the largest such power of two.
    layer.zero_grad()
    (layer(x).float().pow(2).sum() * (2 * scaler.loss_scale)).backward()
    assert has_inf_or_nan([p.grad for p in layer.parameters()])


# ---- the factory -----------------------------------------------------------------------------


def test_factory_defaults_are_deepspeeds():
    scaler = make_loss_scaler({})
    assert isinstance(scaler, DynamicLossScaler)
    assert scaler.loss_scale == 2.0**16 and scaler.scale_window == 1000
    assert scaler.delayed_shift == 2 and scaler.consecutive_hysteresis is False
    assert scaler.min_scale == 1.0 and scaler.scale_factor == 2.0
    assert FP16_DEFAULTS["hysteresis"] == 2


def test_factory_reads_dicts_and_attribute_objects():
    keys = dict(
        loss_scale=0,
        initial_scale_power=12,
        loss_scale_window=300,
        hysteresis=4,
        consecutive_hysteresis=True,
        min_loss_scale=0.25,
    )
    for config in (keys, SimpleNamespace(**keys)):
        scaler = make_loss_scaler(config)
        assert (scaler.loss_scale, scaler.scale_window, scaler.delayed_shift) == (4096, 300, 4)
        assert scaler.consecutive_hysteresis is True and scaler.min_scale == 0.25
    static = make_loss_scaler(SimpleNamespace(loss_scale=128.0, enabled=True))
    assert isinstance(static, StaticLossScaler) and static.loss_scale == 128.0


@pytest.mark.parametrize(
    "config, message",
    [
        ({"loss_scale": -1}, r"fp16.loss_scale must be a finite number >= 0 .*got -1"),
        ({"loss_scale": "auto"}, r"fp16.loss_scale must be .*got 'auto'"),
        ({"initial_scale_power": 2.5}, r"fp16.initial_scale_power must be an integer .*got 2.5"),
        ({"initial_scale_power": 400}, r"fp16.initial_scale_power .*\[-126, 127\], got 400"),
        ({"loss_scale_window": 0}, r"fp16.loss_scale_window must be an integer >= 1, got 0"),
        ({"hysteresis": 0}, r"fp16.hysteresis must be an integer >= 1, got 0"),
        (
            {"consecutive_hysteresis": 1},
            r"fp16.consecutive_hysteresis must be true or false, got 1",
        ),
        ({"min_loss_scale": 0}, r"fp16.min_loss_scale must be a positive finite number, got 0"),
        (
            {"min_loss_scale": 8, "initial_scale_power": 2},
            r"fp16.min_loss_scale \(8.0\) must be <= 2 \*\* fp16.initial_scale_power \(4.0\)",
        ),
    ],
)
def test_factory_errors_name_the_config_key(config, message):
    with pytest.raises(ValueError, match=message):
        make_loss_scaler(config)


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: DynamicLossScaler(init_scale=float("inf")),
            r"init_scale must be a positive finite number, got inf",
        ),
        (lambda: DynamicLossScaler(scale_factor=1.0), r"scale_factor must be > 1, got 1.0"),
        (lambda: DynamicLossScaler(scale_window=0), r"scale_window must be an integer >= 1, got 0"),
        (
            lambda: DynamicLossScaler(delayed_shift=0),
            r"delayed_shift must be an integer >= 1, got 0",
        ),
        (
            lambda: DynamicLossScaler(min_scale=-1),
            r"min_scale must be a positive finite number, got -1",
        ),
        (
            lambda: DynamicLossScaler(init_scale=2, min_scale=4),
            r"min_scale \(4\) must be <= init_scale \(2\)",
        ),
        (lambda: StaticLossScaler(0), r"scale must be a positive finite number, got 0"),
        (
            lambda: DynamicLossScaler().load_state_dict({"cur_scale": 2.0, "cur_hysteresis": 1}),
            r"needs the key 'cur_iter'",
        ),
        (
            lambda: DynamicLossScaler().load_state_dict(
                {"cur_scale": 2.0, "cur_iter": 3, "last_overflow_iter": -1, "cur_hysteresis": 0}
            ),
            r"state_dict\['cur_hysteresis'\] must be an integer >= 1, got 0",
        ),
    ],
)
def test_bad_arguments_are_named(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_check_state_dict_refuses_as_loading_would_and_changes_nothing():
    """What a checkpoint runs before it restores anything (runtime/checkpoint/loader.py)."""
    scaler = DynamicLossScaler(init_scale=2.0**8, scale_window=3, delayed_shift=2)
    for overflow in (True, False, True, True, False):
        scaler.update_scale(overflow)
    before = dict(vars(scaler))
    good = {"cur_scale": 4.0, "cur_iter": 9, "last_overflow_iter": 3, "cur_hysteresis": 1}
    scaler.check_state_dict(good)
    scaler.check_state_dict({"cur_scale": 16.0})  # a static run's: loads too
    for bad, message in [
        ({**good, "cur_hysteresis": 0}, r"cur_hysteresis'\] must be an integer >= 1"),
        ({**good, "cur_scale": float("nan")}, r"cur_scale'\] must be a positive finite"),
        ({"cur_scale": 2.0, "cur_iter": 1}, r"needs the key 'last_overflow_iter'"),
    ]:
        with pytest.raises(ValueError, match=message):
            scaler.check_state_dict(bad)
    assert vars(scaler) == before
    static = StaticLossScaler(128.0)
    with pytest.raises(ValueError, match=r"cur_scale'\] must be a positive finite"):
        static.check_state_dict({"cur_scale": 0.0})
    static.check_state_dict({"cur_scale": 2.0})
    assert static.cur_scale == 128.0


def test_state_dicts_of_the_other_kind():
    """The configured kind stays: a static run's scale starts a fresh dynamic trajectory (not
    below min_scale); a dynamic run's scale does not replace a static one."""
    dynamic = DynamicLossScaler(init_scale=2.0**10, min_scale=8.0, delayed_shift=3)
    dynamic.update_scale(True)
    dynamic.load_state_dict({"cur_scale": 64.0})
    assert dynamic.state_dict() == {"cur_scale": 64.0, "cur_iter": 0, "last_overflow_iter": -1,
                                    "cur_hysteresis": 3}  # fmt: skip
    dynamic.load_state_dict({"cur_scale": 2.0})
    assert dynamic.cur_scale == 8.0
    static = StaticLossScaler(128.0)
    static.load_state_dict(DynamicLossScaler(init_scale=2.0**12).state_dict())
    assert static.cur_scale == 128.0
    static.load_state_dict({"cur_scale": 32.0})  # the same kind: restored (DeepSpeed does)
    assert static.cur_scale == 32.0


# ---- has_inf_or_nan --------------------------------------------------------------------------


def _reference_has_inf_or_nan(tensors):
    return any(not bool(torch.isfinite(t).all()) for t in tensors)


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_finds_a_single_bad_value_anywhere(dtype, bad):
    sizes = [1, 7, 1025, 4099]  # odd sizes: scalar loops and vector tails both
    for victim in range(len(sizes)):
        n = sizes[victim]
        for position in sorted({0, n // 2, n - 1, int(torch.randint(n, ()))}):
            tensors = [torch.randn(size, dtype=dtype) * 100 for size in sizes]
            tensors[victim][position] = bad
            assert has_inf_or_nan(tensors), (victim, position)
            assert bool(found_inf_or_nan(tensors)), (victim, position)
            assert _reference_has_inf_or_nan(tensors)


@pytest.mark.parametrize("dtype", DTYPES)
def test_finite_tensors_are_clean(dtype):
    tensors = [torch.randn(n, dtype=dtype) for n in (3, 1000, 4097)]
    assert not has_inf_or_nan(tensors) and not bool(found_inf_or_nan(tensors))


def test_finite_values_whose_sum_overflows_are_not_an_overflow():
    # A sum-only check would call these inf; the check must stay exact.
    big_half = torch.full((3001,), 60000.0, dtype=torch.float16)
    big_float = torch.full((17,), 3e38, dtype=torch.float32)
    big_bf16 = torch.full((9,), 3e38, dtype=torch.bfloat16)
    mixed = torch.tensor([-3e38, 3e38, -3e38, 3e38] * 5, dtype=torch.float32)
    tensors = [big_half, big_float, big_bf16, mixed]
    assert not _reference_has_inf_or_nan(tensors)
    assert not has_inf_or_nan(tensors)
    assert not bool(found_inf_or_nan(tensors))
    big_float[5] = float("nan")
    assert has_inf_or_nan(tensors) and bool(found_inf_or_nan(tensors))


def test_mixed_dtypes_views_and_odd_inputs():
    grads = [
        torch.randn(5, 6, dtype=torch.float16).t(),  # non-contiguous
        torch.randn(10, dtype=torch.bfloat16)[::3],
        torch.randn(4, dtype=torch.complex64),
        torch.empty(0),
        torch.arange(5),  # integers cannot hold inf: ignored
    ]
    assert not has_inf_or_nan(grads)
    assert not has_inf_or_nan([])
    assert not bool(found_inf_or_nan([]))
    grads[2][1] = complex(0, float("inf"))
    assert has_inf_or_nan(grads) and bool(found_inf_or_nan(grads))
    grads[2][1] = 0
    grads[0][3, 2] = float("-inf")
    assert has_inf_or_nan(grads) and bool(found_inf_or_nan(grads))
    assert DynamicLossScaler.has_inf_or_nan(grads) and StaticLossScaler.has_inf_or_nan(grads)
    with pytest.raises(TypeError, match=r"tensors\[1\] must be a torch.Tensor, got float"):
        has_inf_or_nan([torch.zeros(2), 1.0])


def test_found_inf_or_nan_is_a_tensor_flag():
    flag = found_inf_or_nan([torch.randn(9)])
    assert isinstance(flag, torch.Tensor) and flag.dtype == torch.bool and flag.dim() == 0
