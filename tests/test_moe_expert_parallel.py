"""Expert parallelism on 2 real gloo processes: DeepSpeed's group layout, and an MoE layer with
ep_size=2 equal to the same layer with all experts on one rank (same tokens, same gate weights)
in output, l_aux, exp_counts and every gradient."""

import moe_parallel_jobs as jobs
import pytest
import torch


@pytest.mark.parametrize("data_before_expert", [False, True])
@pytest.mark.parametrize("ep_size", [1, 2])
def test_group_layout(pool2, ep_size, data_before_expert):
    layouts = pool2.run(jobs.group_layout, ep_size, data_before_expert, timeout=120.0)
    for rank, layout in enumerate(layouts):
        # Two ranks: the expert-parallel group is everyone when ep_size=2, else just this rank,
        # whatever the order; expert-data-parallel groups are the complement.
        assert layout["ep_ranks"] == ([0, 1] if ep_size == 2 else [rank])
        assert layout["ep_world"] == ep_size and layout["ep_rank"] == (rank if ep_size == 2 else 0)
        assert layout["edp_ranks"] == ([rank] if ep_size == 2 else [0, 1])
        assert layout["edp_world"] == 2 // ep_size
        assert layout["src"] == (rank if ep_size == 2 else 0)
        assert layout["max"] == f"ep_size_{ep_size}"


def test_ep_size_larger_than_the_world_is_named(pool2):
    for message in pool2.run(jobs.bad_ep_size, timeout=120.0):
        assert "ep_size=4 is larger than the world size" in message
        assert "allowed values: 1, 2" in message


@pytest.mark.parametrize(
    "k, drop_tokens, use_residual",
    [(1, True, False), (2, True, True), (1, False, False), (2, False, False)],
)
def test_two_ranks_equal_one(pool2, k, drop_tokens, use_residual):
    seed = int(torch.randint(2**31, ()))
    for rank, diffs in enumerate(pool2.run(jobs.expert_parallel_matches_one_rank, k, drop_tokens,
                                           use_residual, seed, timeout=300.0)):  # fmt: skip
        assert diffs["counts_equal"], rank
        for key in ("output", "l_aux", "input_grad", "shared_grad", "expert_grad"):
            assert diffs[key] <= 1e-6, (rank, key, diffs)
        assert diffs["output_scale"] > 1e-3  # the comparison is not of zeros


@pytest.mark.parametrize(
    "stage, ep_size, k, clip, optimizer_kind",
    [
        (0, 2, 1, 0.0, "sgd"),
        (1, 2, 2, 0.05, "adamw"),
        (1, 2, 1, 0.0, "sgd"),
        (2, 2, 1, 0.05, "config"),
        (2, 2, 2, 0.0, "sgd"),
        (2, 1, 2, 0.05, "sgd"),
        (0, 1, 1, 0.0, "config"),
    ],
)
@pytest.mark.parametrize("gas", [1, 2])
def test_engine_expert_parallel_training_equals_one_process(
    pool2, stage, ep_size, k, clip, optimizer_kind, gas
):
    """Dense + MoE model through the engine on 2 ranks (experts split over them when ep_size=2)
    equals one process holding all experts trained with the same optimizer on both ranks'
    batches, with DeepSpeed's averaging (dense and expert gradients divided by the world size)."""
    seed = int(torch.randint(2**20, ()))
    for rank, diffs in enumerate(pool2.run(jobs.engine_expert_parallel_matches_reference, stage,
                                           ep_size, k, clip, optimizer_kind, seed, gas,
                                           timeout=300.0)):  # fmt: skip
        assert diffs["trained"] > 1e-2, diffs  # the comparison is not of untrained weights
        assert diffs["dense"] <= 1e-6 and diffs["expert"] <= 1e-6, (rank, diffs)
        for norm, ref_norm in zip(diffs["norms"], diffs["ref_norms"]):
            assert abs(norm - ref_norm) <= 1e-5 * max(1.0, ref_norm), (rank, diffs)


@pytest.mark.parametrize("stage", [0, 2])
def test_engine_trains_ep_size_1_experts_in_their_own_groups(pool2, stage):
    seed = int(torch.randint(2**31, ()))
    digests = pool2.run(jobs.engine_trains_moe_with_ep_size_1, stage, seed, timeout=300.0)
    assert digests[0] == digests[1]  # every gradient, expert ones included, was averaged


@pytest.fixture(scope="module")
def pool4():
    from dist_pool import DistributedPool

    pool = DistributedPool(4)
    yield pool
    pool.close()


@pytest.mark.parametrize(
    "stage, ep_size, k, clip, optimizer_kind",
    [
        (0, 2, 1, 0.05, "sgd"),
        (1, 2, 2, 0.05, "sgd"),
        (2, 2, 1, 0.0, "adamw"),
        (2, 4, 1, 0.05, "sgd"),
    ],
)
def test_engine_expert_data_parallel_training_on_four_ranks(
    pool4, stage, ep_size, k, clip, optimizer_kind
):
    """4 ranks, ep_size 2: each expert lives on 2 ranks (its expert-data-parallel group, over
    which its gradients are reduced and, at stages 1/2, its optimizer state sharded), the dense
    layers on all 4; ep_size 4: one expert per rank. Equal to one process holding all experts."""
    seed = int(torch.randint(2**20, ()))
    for rank, diffs in enumerate(pool4.run(jobs.engine_expert_parallel_matches_reference, stage,
                                           ep_size, k, clip, optimizer_kind, seed,
                                           timeout=300.0)):  # fmt: skip
        assert diffs["trained"] > 1e-2, diffs
        assert diffs["dense"] <= 1e-6 and diffs["expert"] <= 1e-6, (rank, diffs)
        # The dense set over all 4 ranks, the experts' over their group of 4 / ep_size.
        assert diffs["set_sizes"] == {"": 4, f"ep_size_{ep_size}": 4 // ep_size}, diffs
        for norm, ref_norm in zip(diffs["norms"], diffs["ref_norms"]):
            assert abs(norm - ref_norm) <= 1e-5 * max(1.0, ref_norm), (rank, diffs)
