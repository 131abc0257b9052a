"""csrc/zero: the bucket planner, flat copies and the gradient reducer on real gloo groups."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from deepspeed_cpp.ops.zero import (
    BucketPlan,
    flatten_into,
    load_zero,
    make_gradient_reducer,
    plan_buckets,
    unflatten_from,
)


def _check_plan(numels, groups, capacity, world, alignment):
    plan = plan_buckets(numels, groups, capacity=capacity, world_size=world, alignment=alignment)
    covered = {}
    for p, (bucket, offset) in enumerate(zip(plan.param_bucket, plan.param_offset)):
        assert plan.bucket_groups[bucket] == groups[p], "a bucket mixes parameter groups"
        for _, start, end in covered.get(bucket, []):
            assert offset >= end or offset + numels[p] <= start, "parameters overlap"
        covered.setdefault(bucket, []).append((bucket, offset, offset + numels[p]))
        assert offset + numels[p] <= plan.bucket_sizes[bucket]
    for bucket, size in enumerate(plan.bucket_sizes):
        assert size % (world * alignment) == 0 and size > 0
        used = max(end for _, _, end in covered[bucket])
        members = [p for p, b in enumerate(plan.param_bucket) if b == bucket]
        # Never over capacity, except a single parameter larger than it.
        assert used <= capacity or len(members) == 1
        assert size - used < world * alignment or used == 0
    # Buckets follow the parameter order, and close only when the next one would not fit.
    assert plan.param_bucket == sorted(plan.param_bucket)
    return plan


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_plan_covers_every_element_once(world):
    numels = torch.randint(0, 5000, (300,)).tolist() + [100_000, 1, 0, 7]
    groups = sorted(torch.randint(0, 3, (len(numels),)).tolist())
    _check_plan(numels, groups, capacity=20_000, world=world, alignment=16)


def test_plan_is_deterministic_and_matches_hand_computed_example():
    plan = plan_buckets([5, 3, 100, 0, 7], [0, 0, 0, 1, 1], capacity=10, world_size=2, alignment=4)
    assert plan.param_bucket == [0, 0, 1, 2, 2]
    assert plan.param_offset == [0, 5, 0, 0, 0]
    assert plan.bucket_sizes == [8, 104, 8]
    assert plan.bucket_groups == [0, 0, 1]
    again = plan_buckets([5, 3, 100, 0, 7], [0, 0, 0, 1, 1], capacity=10, world_size=2, alignment=4)
    assert again == plan


def _reference_plan(numels, groups, alone, capacity, world, alignment):
    """The packing rule restated: buckets in order, a new one at a group change, when the next
    parameter does not fit, or around a parameter that stays alone."""
    multiple = world * alignment
    param_bucket, param_offset, sizes, bucket_groups = [], [], [], []
    used, open_alone = 0, False
    for numel, group, is_alone in zip(numels, groups, alone):
        fits = (
            bucket_groups
            and not open_alone
            and not is_alone
            and bucket_groups[-1] == group
            and used + numel <= capacity
        )
        if not fits:
            if bucket_groups:
                sizes.append(-(-max(used, 1) // multiple) * multiple)
            bucket_groups.append(group)
            used = 0
        param_bucket.append(len(bucket_groups) - 1)
        param_offset.append(used)
        used += numel
        open_alone = is_alone
    sizes.append(-(-max(used, 1) // multiple) * multiple)
    return param_bucket, param_offset, sizes, bucket_groups


@pytest.mark.parametrize("world", [1, 3])
def test_plan_puts_alone_parameters_in_buckets_of_their_own(world):
    """ZeRO-3 plans partitioned (alone) and persistent parameters in one call; the plan, bucket
    groups included, is the C++ planner's and equals the rule restated in Python."""
    generator = torch.Generator().manual_seed(world)
    count = 200
    numels = torch.randint(0, 400, (count,), generator=generator).tolist()
    groups = sorted(torch.randint(0, 3, (count,), generator=generator).tolist())
    alone = (torch.rand(count, generator=generator) < 0.4).tolist()
    plan = plan_buckets(numels, groups, capacity=1000, world_size=world, alignment=4, alone=alone)
    expected = _reference_plan(numels, groups, alone, 1000, world, 4)
    assert (plan.param_bucket, plan.param_offset, plan.bucket_sizes, plan.bucket_groups) == (
        expected
    )
    for p, is_alone in enumerate(alone):
        if is_alone:
            assert plan.param_bucket.count(plan.param_bucket[p]) == 1
    with pytest.raises(RuntimeError, match=r"alone has 2 entries; expected none or one per"):
        plan_buckets([1, 2, 3], [0, 0, 0], capacity=8, world_size=1, alone=[True, False])


@pytest.mark.parametrize(
    "numels, groups, kwargs, message",
    [
        ([1, 2], [0], dict(capacity=4, world_size=1), "numels has 2 entries but groups has 1"),
        ([1], [0], dict(capacity=0, world_size=1), "must be >= 1, got 0, 1, 16"),
        ([-1], [0], dict(capacity=4, world_size=2), r"numels\[0\] is negative"),
    ],
)
def test_plan_rejects_bad_input(numels, groups, kwargs, message):
    with pytest.raises(RuntimeError, match=message):
        plan_buckets(numels, groups, **kwargs)


def test_flatten_unflatten_round_trip_with_dtype_conversion():
    tensors = [torch.randn(3, 5), torch.randn(7).bfloat16(), torch.randn(4, 2).t()]
    offsets = [0, 16, 23]
    flat = torch.full((40,), -1.0)
    flatten_into(tensors, flat, offsets)
    assert torch.equal(flat[:15], tensors[0].reshape(-1))
    assert torch.equal(flat[16:23], tensors[1].float())
    assert torch.equal(flat[23:31], tensors[2].reshape(-1))
    assert (flat[15] == -1) and (flat[31:] == -1).all()
    targets = [torch.empty_like(t) for t in tensors]
    unflatten_from(flat, targets, offsets)
    for source, target in zip(tensors, targets):
        assert torch.equal(source, target)


def test_flat_copy_errors_name_the_tensor():
    with pytest.raises(
        RuntimeError, match=r"tensors\[1\] \(7 elements at offset 30\) does not fit"
    ):
        flatten_into([torch.zeros(3), torch.zeros(7)], torch.zeros(32), [0, 30])
    with pytest.raises(RuntimeError, match="got 2 tensors but 1 offsets"):
        unflatten_from(torch.zeros(8), [torch.zeros(2), torch.zeros(2)], [0])
    with pytest.raises(RuntimeError, match="flat must be a contiguous 1-D tensor"):
        flatten_into([torch.zeros(2)], torch.zeros(4, 2), [0])


def test_opcheck():
    load_zero()
    flat_args = ([torch.randn(3), torch.randn(2, 2)], torch.zeros(9), [0, 4])
    torch.library.opcheck(torch.ops.deepspeed_cpp.zero_flatten_into.default, flat_args)
    unflat_args = (torch.randn(9), [torch.zeros(3), torch.zeros(2, 2)], [1, 5])
    torch.library.opcheck(torch.ops.deepspeed_cpp.zero_unflatten_from.default, unflat_args)
    for plan_args in (
        ([5, 3, 100], [0, 0, 1], 10, 2, 4),
        ([5, 3, 1], [0, 0, 0], 10, 2, 4, [1, 0, 0]),
    ):
        torch.library.opcheck(
            torch.ops.deepspeed_cpp.zero_plan_buckets.default,
            plan_args,
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
        )


def reducer_job(scatter: bool, order_seed: int, scatter_method: str = "auto"):
    """Each rank hands over its gradients in its own random order; some params are skipped."""
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(1234)
    numels = [int(n) for n in torch.randint(1, 300, (40,), generator=generator)]
    plan = plan_buckets(numels, [0] * 40, capacity=700, world_size=world, alignment=4)
    reducer = make_gradient_reducer(
        dist.group.WORLD, plan, scatter=scatter, scatter_method=scatter_method
    )
    results = []
    for _ in range(2):
        grads = [
            torch.randn(n, generator=generator) * (r + 1) for r in range(world) for n in numels
        ]
        grads = [grads[r * 40 : (r + 1) * 40] for r in range(world)]
        order = torch.randperm(40, generator=torch.Generator().manual_seed(order_seed + rank))
        skipped = {int(order[0])} if rank == 1 else set()  # an unused parameter on rank 1
        for p in order.tolist():
            if p not in skipped:
                reducer.add_grad(
                    p, grads[rank][p].bfloat16().float() if p % 5 == 0 else grads[rank][p]
                )
        held_during = reducer.held_bytes()
        shards = reducer.finish()
        expected = []
        for p in range(40):
            total = torch.zeros(numels[p])
            for r in range(world):
                if not (r == 1 and p in _skipped_on_rank1(order_seed, world)):
                    g = grads[r][p]
                    total += g.bfloat16().float() if p % 5 == 0 else g
            expected.append(total)
        results.append((shards, expected, held_during, reducer.held_bytes()))
    return plan, results, reducer.collective()


def _skipped_on_rank1(order_seed, world):
    order = torch.randperm(40, generator=torch.Generator().manual_seed(order_seed + 1))
    return {int(order[0])}


# (scatter, scatter_method, the collective the reducer must have chosen on gloo): "auto" takes
# all-reduce + slice there (gloo's reduce-scatter is slower, benchmarks/bench_collectives.py).
REDUCER_METHODS = [
    (True, "auto", "all_reduce+slice"),
    (True, "reduce_scatter", "reduce_scatter"),
    (True, "all_reduce", "all_reduce+slice"),
    (False, "auto", "all_reduce"),
]


@pytest.mark.parametrize("scatter, scatter_method, expected_collective", REDUCER_METHODS)
def test_reducer_sums_gradients_in_any_hook_order(
    pool3, scatter, scatter_method, expected_collective
):
    order_seed = int(torch.randint(0, 2**30, (1,)))
    outputs = pool3.run(reducer_job, scatter, order_seed, scatter_method)
    world = 3
    for rank, (plan, steps, collective) in enumerate(outputs):
        assert collective == expected_collective
        for shards, expected, held_during, held_after in steps:
            assert held_after == 0 and held_during > 0
            for bucket, size in enumerate(plan.bucket_sizes):
                full = torch.zeros(size)
                for p in plan.members(bucket):
                    full[plan.param_offset[p] : plan.param_offset[p] + plan.param_numel[p]] = (
                        expected[p]
                    )
                want = full.chunk(world)[rank] if scatter else full
                torch.testing.assert_close(shards[bucket], want, rtol=1e-6, atol=1e-5)


def double_hand_over_job():
    plan = plan_buckets([4, 4], [0, 0], capacity=100, world_size=dist.get_world_size())
    reducer = make_gradient_reducer(dist.group.WORLD, plan, scatter=True)
    reducer.add_grad(0, torch.ones(4))
    try:
        reducer.add_grad(0, torch.ones(4))
    except RuntimeError as error:
        message = str(error)
    try:
        reducer.add_grad(1, torch.ones(5))
    except RuntimeError as error:
        message += "\n" + str(error)
    try:
        reducer.add_grad(1, torch.ones(4, device="meta"))
    except RuntimeError as error:
        message += "\n" + str(error)
    try:
        reducer.accumulate_into([torch.zeros(plan.shard_size(0), device="meta")], 1.0)
    except RuntimeError as error:
        message += "\n" + str(error)
    reducer.add_grad(1, torch.ones(4))
    reducer.finish()
    return message + "\n" + reducer.device()


def in_order_job(scatter_method: str):
    """Gradients arrive bucket by bucket, as in backward: a few full buckets are held at most."""
    world = dist.get_world_size()
    generator = torch.Generator().manual_seed(99)
    numels = [int(n) for n in torch.randint(50, 300, (60,), generator=generator)]
    plan = plan_buckets(numels, [0] * 60, capacity=400, world_size=world, alignment=4)
    reducer = make_gradient_reducer(
        dist.group.WORLD, plan, scatter=True, scatter_method=scatter_method
    )
    by_bucket = sorted(range(60), key=lambda p: (plan.param_bucket[p], plan.param_offset[p]))
    grads = {p: torch.randn(numels[p], generator=generator) for p in range(60)}
    for p in by_bucket:
        reducer.add_grad(p, grads[p])
    shards = reducer.finish()
    expected = []
    for bucket, size in enumerate(plan.bucket_sizes):
        full = torch.zeros(size)
        for p in plan.members(bucket):
            full[plan.param_offset[p] : plan.param_offset[p] + numels[p]] = grads[p] * world
        expected.append(full.chunk(world)[dist.get_rank()])
    return plan, shards, expected, reducer.peak_held_bytes(), reducer.held_bytes()


@pytest.mark.parametrize("scatter_method", ["all_reduce", "reduce_scatter"])
def test_reducer_keeps_only_a_window_of_full_buckets(pool3, scatter_method):
    """Reduced buckets are cut down to their shard while backward goes on: the peak is a few
    full buckets plus the shards, well under a full fp32 copy of the gradients."""
    window = 2  # GradientReducer::kMaxReductionsInFlight
    for plan, shards, expected, peak, held_after in pool3.run(in_order_job, scatter_method):
        assert len(plan.bucket_sizes) >= 20 and held_after == 0
        for shard, want in zip(shards, expected):
            torch.testing.assert_close(shard, want, rtol=1e-6, atol=1e-5)
        full_bytes = 4 * sum(plan.bucket_sizes)
        bound = 4 * (window + 2) * max(plan.bucket_sizes) + full_bytes // 3
        assert peak <= bound < full_bytes


def accumulate_job(scatter: bool):
    """Reduced buckets go straight into destinations: written on an overwrite step, then added."""
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(5)
    numels = [int(n) for n in torch.randint(20, 200, (30,), generator=generator)]
    plan = plan_buckets(
        numels, [0] * 30, capacity=300, world_size=world if scatter else 1, alignment=4
    )
    reducer = make_gradient_reducer(dist.group.WORLD, plan, scatter=scatter)
    sizes = [plan.shard_size(b) for b in range(len(plan.bucket_sizes))]
    destinations = [torch.full((size,), 7.0) for size in sizes]  # stale values to overwrite
    reducer.accumulate_into(destinations, 0.25)
    snapshots, all_grads, harvests = [], [], []
    for overwrite in (True, False):
        grads = [[torch.randn(n, generator=generator) for n in numels] for _ in range(world)]
        all_grads.append(grads)
        reducer.set_overwrite(overwrite)
        seen = [(0, [])]  # (harvested(), the destinations it says are final) as it grows
        for p in torch.randperm(30, generator=torch.Generator().manual_seed(rank)).tolist():
            reducer.add_grad(p, grads[rank][p])
            if reducer.harvested() != seen[-1][0]:
                seen.append(
                    (reducer.harvested(), [d.clone() for d in destinations[: reducer.harvested()]])
                )
        returned = reducer.finish()
        assert all(r.data_ptr() == d.data_ptr() for r, d in zip(returned, destinations))
        snapshots.append([d.clone() for d in destinations])
        harvests.append((seen, reducer.harvested(), reducer.spare_bytes()))
    try:
        reducer.accumulate_into([torch.zeros(3)] * len(sizes), 1.0)
        message = "no error"
    except RuntimeError as error:
        message = str(error)
    return plan, all_grads, snapshots, reducer.held_bytes(), message, harvests


@pytest.mark.parametrize("scatter", [True, False])
def test_reducer_accumulates_into_destinations(pool3, scatter):
    world = 3
    for rank, (plan, all_grads, snapshots, held, message, harvests) in enumerate(
        pool3.run(accumulate_job, scatter)
    ):
        # harvested(): a growing prefix of buckets whose destinations already hold their final
        # value for the step, before finish() (which harvests the rest and resets it to 0).
        # The reduced buckets' buffers are kept for the next ones (the second step fills them
        # again, stale values and all; the snapshots below show nothing leaks through): three,
        # the largest (a bucket may have filled a spare larger than itself).
        largest = sorted(plan.bucket_sizes, reverse=True)
        for _, _, spare in harvests:
            assert 4 * sum(largest[:3]) <= spare <= 4 * 3 * largest[0], (spare, largest)
        for (seen, after_finish, _), snapshot in zip(harvests, snapshots):
            counts = [count for count, _ in seen]
            assert counts == sorted(counts) and 0 < counts[-1] < len(plan.bucket_sizes), counts
            for count, prefix in seen:
                for bucket in range(count):
                    assert torch.equal(prefix[bucket], snapshot[bucket]), (count, bucket)
            assert after_finish == 0
        total = None
        for grads, snapshot in zip(all_grads, snapshots):
            for bucket, size in enumerate(plan.bucket_sizes):
                full = torch.zeros(size)
                for p in plan.members(bucket):
                    offset, numel = plan.param_offset[p], plan.param_numel[p]
                    full[offset : offset + numel] = sum(grads[r][p] for r in range(world))
                want = 0.25 * (full.chunk(world)[rank] if scatter else full)
                if total is not None:
                    want = want + total[bucket]
                torch.testing.assert_close(snapshot[bucket], want, rtol=1e-6, atol=1e-6)
            total = snapshot
        assert held == 0
        assert "destination 0 must be a contiguous 1-D float32 tensor of" in message
        assert "got dtype Float and shape [3]" in message


def unknown_method_job():
    plan = plan_buckets([4], [0], capacity=100, world_size=dist.get_world_size())
    try:
        make_gradient_reducer(dist.group.WORLD, plan, scatter=True, scatter_method="ring")
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_reducer_rejects_an_unknown_scatter_method(pool3):
    for message in pool3.run(unknown_method_job):
        assert "scatter_method must be 'auto', 'reduce_scatter' or 'all_reduce', got 'ring'" in (
            message
        )


def test_reducer_errors(pool3):
    for message in pool3.run(double_hand_over_job):
        assert "the gradient of param 0 was already handed over in this step" in message
        assert "param 1 has 4 elements but its gradient has 5" in message
        assert "the gradient of param 1 is on meta but the reducer's buffers are on cpu" in message
        assert "destination 0 is on meta but the reducer's buffers are on cpu" in message
        assert message.endswith("\ncpu")


def rank_major_job(scatter_method: str, seed: int):
    """ZeRO-3's layout: bucket 0 holds several parameters rank by rank (rank r's shard is every
    member's piece r back to back), bucket 1 one parameter laid out contiguously."""
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(seed)
    numels = [int(n) for n in torch.randint(1, 90, (5,), generator=generator)] + [37]
    pieces = [-(-n // (world * 4)) * 4 for n in numels[:5]]  # per rank, aligned to 4
    offsets = [sum(pieces[:i]) for i in range(5)] + [0]
    plan = BucketPlan(
        [0] * 5 + [1], offsets, numels, [world * sum(pieces), world * 16], [0, 0], world
    )
    reducer = make_gradient_reducer(
        dist.group.WORLD,
        plan,
        scatter=True,
        scatter_method=scatter_method,
        rank_major=pieces + [0],
    )
    grads = [[torch.randn(n, generator=generator) for n in numels] for _ in range(world)]
    missing = int(torch.randint(0, 5, (1,), generator=generator))  # unused on rank 1 only
    for p in torch.randperm(6, generator=torch.Generator().manual_seed(seed + rank)).tolist():
        if not (rank == 1 and p == missing):
            reducer.add_grad(p, grads[rank][p].view(-1, 1) if p == 2 else grads[rank][p])
    shards = reducer.finish()
    errors = []
    for bad in ([pieces[0] + 4] + pieces[1:] + [0], pieces[:4] + [0, 0], [1] * 5):
        try:
            make_gradient_reducer(dist.group.WORLD, plan, scatter=True, rank_major=bad)
            errors.append("no error")
        except RuntimeError as error:
            errors.append(str(error))
    return numels, pieces, grads, missing, shards, errors


@pytest.mark.parametrize("scatter_method", ["reduce_scatter", "all_reduce"])
def test_reducer_lays_a_unit_out_rank_by_rank(pool3, scatter_method):
    seed = int(torch.randint(0, 2**30, (1,)))
    world = 3
    for rank, (numels, pieces, grads, missing, shards, errors) in enumerate(
        pool3.run(rank_major_job, scatter_method, seed)
    ):
        expected = []
        for p in range(5):
            total = sum(grads[r][p] for r in range(world) if not (r == 1 and p == missing))
            padded = torch.zeros(world * pieces[p])
            padded[: numels[p]] = total
            expected.append(padded.view(world, pieces[p])[rank])
        torch.testing.assert_close(shards[0], torch.cat(expected), rtol=1e-6, atol=1e-5)
        whole = torch.zeros(world * 16)
        whole[:37] = sum(grads[r][5] for r in range(world))
        torch.testing.assert_close(shards[1], whole.view(world, 16)[rank], rtol=1e-6, atol=1e-5)
        assert "does not continue its bucket's shard at" in errors[0]
        assert "bucket 0 mixes rank-major and contiguous params (param 4)" in errors[1]
        assert "lay_out_rank_major: 5 shard sizes for 6 params" in errors[2]
