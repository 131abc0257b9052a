"""Expert parallelism on 2 real gloo processes: DeepSpeed's group layout, and an MoE layer with
ep_size=2 equal to the same layer with all experts on one rank (same tokens, same gate weights)
in output, l_aux, exp_counts and every gradient; training through the engine equal to one
process holding every expert; and checkpoints of such models (the same pools, reused): DeepSpeed's
per-expert files, a bitwise resume at the same layout, resharding by global expert name to another
ep_size and world size (masters and optimizer state element for element), zero_to_fp32 and
save_16bit_model holding every expert, and a changed num_experts refused by name."""

import json
import shutil

import moe_checkpoint_jobs as checkpoint_jobs
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


# The five option rows cover every pair of their values; gradient accumulation joins them
# pairwise (each value of every option with gas 1 and with gas 2: 8 runs, not the 14 of every
# row at both; adamw, in one row only, runs at both).
@pytest.mark.parametrize(
    "stage, ep_size, k, clip, optimizer_kind, gas",
    [
        (0, 2, 1, 0.0, "sgd", 1),
        (1, 2, 2, 0.05, "adamw", 1),
        (1, 2, 2, 0.05, "adamw", 2),
        (1, 2, 1, 0.0, "sgd", 2),
        (2, 2, 1, 0.05, "config", 1),
        (2, 2, 2, 0.0, "sgd", 2),
        (2, 1, 2, 0.05, "sgd", 1),
        (0, 1, 1, 0.0, "config", 2),
    ],
)
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


# --- offload_optimizer with expert-parallel sets ------------------------------------------------
def _assert_offload_changed_nothing(result, device: str, clip: float) -> None:
    """Offload moves where each set's masters and Adam state live, not what is computed: the
    same kernels on the same fp32 values, so the parameters and grad norms are bitwise equal."""
    in_memory, offloaded = result["in_memory"], result["offloaded"]
    assert in_memory["trained"] > 1e-3, in_memory  # the comparison is not of untrained weights
    assert max(in_memory["norms"]) > clip  # the clipping engaged
    assert offloaded["norms"] == in_memory["norms"], result
    assert sorted(offloaded["params"]) == sorted(in_memory["params"])
    for name, value in in_memory["params"].items():
        assert torch.equal(offloaded["params"][name], value), name
    # The dense set and the experts' each in a home of their own, in several sub-groups.
    assert [kind for kind, _ in offloaded["homes"]] == [device, device], offloaded["homes"]
    assert max(count for _, count in offloaded["homes"]) > 1, offloaded["homes"]
    assert f"optimizer state offloaded to {device}" in offloaded["describe"]
    assert result["left"] == []  # destroy() removed the swap files


@pytest.mark.parametrize(
    "stage, clip, dtype, device, optimizer_kind",
    [
        (1, 0.05, "fp32", "cpu", "config"),
        (2, 0.05, "fp32", "cpu", "adamw"),
        (2, 0.05, "bf16", "cpu", "config"),
        (1, 0.05, "fp16", "cpu", "config"),
        (2, 0.05, "fp32", "nvme", "config"),
    ],
)
def test_offloaded_expert_sets_equal_in_memory_on_two_ranks(
    pool2, tmp_path, stage, clip, dtype, device, optimizer_kind
):
    for result in pool2.run(jobs.engine_offload_matches_in_memory, stage, clip, dtype, device,
                            str(tmp_path), optimizer_kind, timeout=300.0):  # fmt: skip
        _assert_offload_changed_nothing(result, device, clip)


@pytest.mark.parametrize("stage", [1, 2])
def test_offloaded_expert_sets_equal_in_memory_on_four_ranks(pool4, tmp_path, stage):
    """ep_size 2 on 4 ranks: the experts' state sharded over their 2-rank groups on the host."""
    for result in pool4.run(jobs.engine_offload_matches_in_memory, stage, 0.05, "fp32", "cpu",
                            str(tmp_path), "config", timeout=300.0):  # fmt: skip
        _assert_offload_changed_nothing(result, "cpu", 0.05)


def test_offload_settings_refused_with_expert_parallel_are_named(pool2, tmp_path):
    refusals = pool2.run(jobs.offload_refusals, str(tmp_path))
    for delayed, partial, stage0, stage3, nvme, during_backward in refusals:
        assert "delayed_param_update = true with expert-parallel MoE" in delayed, delayed
        assert "ratio = 0.5 with expert-parallel MoE" in partial, partial
        assert "offload_optimizer.device = 'cpu' needs ZeRO stage 1, 2 or 3" in stage0, stage0
        assert "stage 3 with expert-parallel MoE layers" in stage3, stage3
        # Judged against the sets' real optimizer (torch's AdamW), not the stand-in they are
        # built with.
        assert "nvme steps one sub-group at a time, which AdamW cannot" in nvme, nvme
        assert "step_during_backward = true with expert-parallel MoE" in during_backward


# --- checkpoints of expert-parallel models ------------------------------------------------------
EXPERTS = "moe.deepspeed_moe.experts.deepspeed_experts."


@pytest.fixture(scope="module")
def saved(pool2, tmp_path_factory):
    """A checkpoint of ep_size 2 on 2 ranks at ZeRO-2 after 2 steps, and what the run saw."""
    directory = tmp_path_factory.mktemp("moe_checkpoint") / "ckpt"
    seed = int(torch.randint(2**20, ()))
    results = pool2.run(checkpoint_jobs.save_then_resume, str(directory), 2, seed, timeout=300.0)
    return directory, seed, results


def _every_element(directory, key: str) -> dict:
    """Every trainable parameter's ``key`` (the fp32 master, or an element-wise optimizer state)
    read from a checkpoint's shard files through its saved layout, by (global) name."""
    from deepspeed_cpp.runtime.checkpoint.digests import file_digests
    from deepspeed_cpp.runtime.checkpoint.layout import read_metadata
    from deepspeed_cpp.runtime.checkpoint.metadata import ZeroLayout
    from deepspeed_cpp.runtime.checkpoint.shard_reader import ShardReader

    metadata = read_metadata(directory)
    layout = ZeroLayout.from_json(metadata["zero_layout"])
    reader = ShardReader(directory, layout, file_digests(metadata))
    values = {}
    for record in layout.params:
        out = torch.empty(record.numel, dtype=torch.float32)
        reader.read(key, record.bucket, record.offset, record.offset + record.numel, out)
        values[record.name] = out
    return values


def _assert_equal(state: dict, reference: dict) -> None:
    assert sorted(state) == sorted(reference)
    for name in reference:
        assert torch.equal(state[name], reference[name]), name


def _assert_same_training_state(original, resaved) -> None:
    """The masters and Adam state of every parameter, and the consolidated weights, are the
    same in both checkpoints."""
    from deepspeed_cpp.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    _assert_equal(
        get_fp32_state_dict_from_zero_checkpoint(resaved),
        get_fp32_state_dict_from_zero_checkpoint(original),
    )
    for key in ("master", "exp_avg", "exp_avg_sq"):
        ours, theirs = _every_element(original, key), _every_element(resaved, key)
        assert sorted(ours) == sorted(theirs), key
        assert sum(EXPERTS in name for name in ours) == 4 * 4  # 4 experts of 4 tensors
        for name in ours:
            assert torch.equal(ours[name], theirs[name]), (key, name)
        assert max(v.abs().max().item() for v in ours.values()) > 0, key  # not all zeros


def test_same_layout_resume_is_bitwise(saved):
    _, _, results = saved
    for rank, result in enumerate(results):
        assert result["differed_before_load"] > 1e-2, rank  # loading had something to do
        assert result["trained_after_save"] > 1e-3, rank  # the continuation moved the weights
        assert result["loaded_equal"] and result["resumed_equal"], (rank, result)
        assert result["steps"] == 4


def test_files_per_expert_listed_with_digests(saved):
    directory, _, results = saved
    reference = results[0]["saved"]
    metadata = json.loads((directory / "t" / "checkpoint_meta.json").read_text())
    assert metadata["moe"] == {
        "ep_size": 2,
        "layers": [
            {"layer": 0, "module": "moe", "num_experts": 4, "ep_size": 2, "group_name": "ep_size_2"}
        ],
    }
    files = {entry["name"]: entry for entry in metadata["files"]}
    for expert in range(4):
        entry = files[f"layer_0_expert_{expert}_mp_rank_00_model_states.pt"]
        assert entry["rank"] == expert // 2 and len(entry["sha256"]) == 64, entry
        saved_expert = torch.load(directory / "t" / entry["name"], weights_only=True)
        expected = {k: v for k, v in reference.items() if k.startswith(f"{EXPERTS}{expert}.")}
        _assert_equal(saved_expert, expected)
    module = torch.load(directory / "t" / "mp_rank_00_model_states.pt", weights_only=True)
    assert not any(EXPERTS in name for name in module["module"])
    assert "moe.deepspeed_moe.gate.wg.weight" in module["module"]


def test_zero_to_fp32_and_16bit_model_hold_every_expert(saved):
    from deepspeed_cpp.utils.zero_to_fp32 import (
        get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint,
    )

    directory, _, results = saved
    reference = results[0]["saved"]
    assert sum(EXPERTS in name for name in reference) == 16
    _assert_equal(get_fp32_state_dict_from_zero_checkpoint(directory, tag="t"), reference)
    _assert_equal(torch.load(directory / "model16.bin", weights_only=True), reference)
    # One process, ep_size 1: every expert by its global name.
    model = load_state_dict_from_zero_checkpoint(checkpoint_jobs._Net(1, 4), directory, tag="t")
    _assert_equal(dict(model.state_dict()), reference)


def test_damaged_expert_file_is_named(saved, tmp_path):
    from deepspeed_cpp.runtime.checkpoint.errors import IncompleteCheckpointError
    from deepspeed_cpp.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    directory, _, _ = saved
    copy = tmp_path / "t"
    shutil.copytree(directory / "t", copy)
    damaged = copy / "layer_0_expert_3_mp_rank_00_model_states.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x10
    damaged.write_bytes(bytes(data))
    with pytest.raises(IncompleteCheckpointError, match="layer_0_expert_3_mp_rank_00"):
        get_fp32_state_dict_from_zero_checkpoint(copy)


def test_reshard_to_ep_size_1_on_two_ranks(saved, pool2, tmp_path):
    """ep_size 2 -> 1 at ZeRO-1: the experts become dense parameters of every rank; the weights
    and optimizer state are the saved ones element for element, and training on the same
    batches continues as the uninterrupted ep_size-2 run did (other summation orders only)."""
    directory, seed, results = saved
    resave = tmp_path / "ep1"
    out = pool2.run(
        checkpoint_jobs.load_elsewhere, str(directory), 1, 1, seed, str(resave), timeout=300.0
    )
    _assert_equal(out[0]["loaded"], results[0]["saved"])
    _assert_same_training_state(directory / "t", resave / "r")
    uninterrupted = results[0]["uninterrupted"]
    for name, value in out[0]["continued"].items():
        assert (value - uninterrupted[name]).abs().max().item() <= 1e-5, name


def test_reshard_to_four_ranks(saved, pool4, tmp_path):
    """ep_size 2 on 2 ranks -> ep_size 2 on 4 ranks at ZeRO-0: each expert now on two ranks."""
    directory, seed, results = saved
    resave = tmp_path / "w4"
    out = pool4.run(
        checkpoint_jobs.load_elsewhere, str(directory), 2, 0, seed, str(resave), timeout=300.0
    )
    _assert_equal(out[0]["loaded"], results[0]["saved"])
    _assert_same_training_state(directory / "t", resave / "r")


def test_offloaded_checkpoint_round_trip(saved, pool2, tmp_path):
    """The saved run again with offload_optimizer cpu (the fixture's seed): it resumes bitwise,
    and its checkpoint holds the in-memory run's weights, masters and Adam state exactly. (The
    fixture's torch AdamW cannot step on NVMe, which is refused: see the refusals above.)"""
    directory, seed, results = saved
    offloaded = tmp_path / "offloaded"
    out = pool2.run(checkpoint_jobs.save_then_resume, str(offloaded), 2, seed, {"device": "cpu"},
                    timeout=300.0)  # fmt: skip
    for rank, result in enumerate(out):
        assert result["differed_before_load"] > 1e-2, rank
        assert result["loaded_equal"] and result["resumed_equal"], (rank, result)
        assert result["steps"] == 4
    _assert_equal(out[0]["saved"], results[0]["saved"])
    _assert_equal(out[0]["uninterrupted"], results[0]["uninterrupted"])
    _assert_same_training_state(directory / "t", offloaded / "t")


def test_other_num_experts_is_refused(saved, pool2):
    directory, _, _ = saved
    for message in pool2.run(checkpoint_jobs.load_other_num_experts, str(directory), timeout=300.0):
        assert "CheckpointMismatchError" in message, message
        assert "num_experts=4" in message and "num_experts=2" in message, message
