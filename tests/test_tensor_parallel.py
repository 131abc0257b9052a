"""Tensor parallelism for training (AutoTP) on 2 real gloo processes: GPT-2 (Conv1D, fused q/k/v)
and Llama (grouped key/value heads, biased row-parallel o_proj) split over both ranks train
through the engine equal to the unsplit model trained by torch's AdamW in one process (losses,
gradient norms with clipping active, weights), at ZeRO 0, 1 and 2; save_16bit_model writes the
unsplit weights, which a fresh one-process model loads; T5 (per-head relative position bias)
and a model split by the config's layer_specs match the unsplit model's loss and gradients; the
config's keys and the refusals a TP set-up can meet."""

import pytest
import torch
import tp_jobs as jobs

from deepspeed_cpp.runtime.config import DeepSpeedConfig, DeepSpeedConfigError


def _relative(pair) -> float:
    ours, expected = pair
    return abs(ours - expected) / max(abs(expected), 1e-12)


@pytest.mark.parametrize(
    "kind, stage, clip",
    [("gpt2", 0, 0.0), ("gpt2", 1, 0.05), ("gpt2", 2, 1.0), ("llama", 1, 0.05), ("llama", 2, 0.0)],
)
def test_trains_like_one_process(pool2, tmp_path, kind, stage, clip):
    seed = int(torch.randint(2**31, ()))
    results = pool2.run(
        jobs.trains_like_one_process, kind, stage, clip, seed, str(tmp_path), timeout=600.0
    )
    for rank, result in enumerate(results):
        where = (rank, seed, result)
        assert result["names_equal"], where
        assert result["moved"] > 1e-4, where  # the comparison is of trained weights
        assert result["planned_is_split"], where  # planned_slices: the split made
        assert result["weight_diff"] <= 1e-5, where
        assert result["saved_diff"] == 0.0, where  # the file holds exactly the gathered weights
        assert result["output_diff"] <= 1e-5, where
        for pair in result["losses"] + result["norms"]:
            assert _relative(pair) <= 1e-5, where
        if clip:
            assert result["norms"][0][1] > clip, where  # clipping was active
        split = result["split"]
        if kind == "gpt2":
            # Conv1D stores (in, out): c_attn keeps 3 * 32 / 2 output columns, c_proj 32 / 2
            # input rows.
            assert split["transformer.h.0.attn.c_attn"] == ("LinearLayer", (32, 48)), where
            assert split["transformer.h.1.attn.c_proj"] == ("LinearAllreduce", (16, 32)), where
            assert split["transformer.h.0.mlp.c_fc"] == ("LinearLayer", (32, 64)), where
            assert split["transformer.h.0.mlp.c_proj"] == ("LinearAllreduce", (64, 32)), where
            assert "lm_head" not in split, where  # tied to wte: kept whole (DeepSpeed's rule)
        else:
            assert split["model.layers.0.self_attn.k_proj"] == ("LinearLayer", (8, 32)), where
            assert split["model.layers.1.self_attn.o_proj"] == ("LinearAllreduce", (32, 16))
            assert split["model.layers.0.mlp.down_proj"] == ("LinearAllreduce", (32, 24)), where
            # The untied lm_head split by vocabulary (64 / 2), its logits gathered.
            assert split["lm_head"] == ("LinearLayer", (32, 32)), where
            assert len(split) == 15, where


@pytest.mark.parametrize("kind", ["t5", "custom"])
def test_split_matches_whole(pool2, kind):
    seed = int(torch.randint(2**31, ()))
    for rank, result in enumerate(pool2.run(jobs.split_matches_whole, kind, seed, timeout=300.0)):
        where = (rank, seed, result)
        assert result["names_equal"], where
        assert result["loss_diff"] <= 1e-5, where
        assert result["planned_is_split"], where
        assert result["grad_diff"] <= 1e-5 * max(1.0, result["grad_scale"]), where
        assert result["grad_scale"] > 0.0, where
        if kind == "t5":
            assert (
                "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
                in (result["split"])
            ), where
        else:
            assert result["split"] == ["1.bias", "1.weight", "3.weight"], where


def test_refusals(pool2):
    for found in pool2.run(jobs.refusals, timeout=300.0):
        assert "tp_model_init(tp_size=2)" in found["mismatch"], found
        assert "autotp_size is 4" in found["mismatch"], found
        assert "zero_optimization.stage 3" in found["stage3"], found
        assert "autotp_size = 3 does not divide the world size 2" in found["size"], found
        assert "no tensor-parallel policy for model type None (Sequential)" in found["no_policy"]


def test_config_keys():
    base = {"gradient_clipping": 0.0, "train_batch_size": 8, "tensor_parallel": {"autotp_size": 2}}
    assert DeepSpeedConfig.read(base).tensor_parallel.autotp_size == 2
    accepted = {**base, "tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": False,
                                            "tp": {"tp_size": 2}, "dtype": "fp32"}}  # fmt: skip
    assert DeepSpeedConfig.load(accepted, world_size=2).tensor_parallel.autotp_size == 2
    refused = {**base, "tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": True}}
    with pytest.raises(DeepSpeedConfigError, match="tensor_parallel.tp_overlap_comm"):
        DeepSpeedConfig.load(refused, world_size=2)


def test_tp2_by_dp2_on_four_ranks(pool4, tmp_path):
    seed = int(torch.randint(2**31, ()))
    results = pool4.run(jobs.tp2_dp2_trains_like_one_process, seed, str(tmp_path), timeout=600.0)
    for rank, result in enumerate(results):
        where = (rank, seed, result)
        layout = result["layout"]
        # DeepSpeed's layout: TP groups consecutive ranks, DP groups strided.
        assert layout["tp_ranks"] == [rank // 2 * 2, rank // 2 * 2 + 1], where
        assert layout["dp_ranks"] == [rank % 2, rank % 2 + 2], where
        # DeepSpeed's batch rule under AutoTP counts every rank (micro x accumulation x 4).
        assert layout["dp_world"] == 2 and layout["train_batch_size"] == 4 * jobs.MICRO_BATCH
        for ours, expected in result["norms"]:
            assert abs(ours - expected) <= 1e-5 * expected and expected > 0.05, where
        assert result["weight_diff"] <= 1e-5, where
        assert result["saved_diff"] <= 1e-5, where
        assert result["consolidated_diff"] <= 1e-6, where  # zero_to_fp32, loaded at TP 1
        assert result["reload_equal"], where
        assert result["resumed_diff"] <= 1e-5, where
    # The two TP ranks of a DP rank saw the same loss; the two DP ranks different batches.
    assert results[0]["losses"] == results[1]["losses"]
    assert results[2]["losses"] == results[3]["losses"]
    assert results[0]["losses"] != results[2]["losses"]


def test_checkpoint_loads_at_another_tp_size(pool2, tmp_path):
    seed = int(torch.randint(2**31, ()))
    for rank, result in enumerate(pool2.run(jobs.reload_at_other_tp_size, seed, str(tmp_path))):
        where = (rank, seed, result)
        assert result["differs_before"] > 1e-3 and result["steps_loaded"] == 2, where
        assert result["loaded_diff"] == 0.0, where  # the saved weights, exactly
        assert result["loaded_at_zero3_diff"] == 0.0, where
        # Weights and Adam state (m, v, step) re-cut: training continues as uninterrupted.
        assert result["tp2_to_tp1"] <= 1e-6, where
        assert result["tp1_to_tp2"] <= 1e-6, where
        assert result["without_state"] > 1e-4, where  # the optimizer state is what matters
        assert "cannot be re-cut" in result["refusal"] or "shape" in result["refusal"], where
        assert "transformer." in result["refusal"], where


@pytest.mark.parametrize("kind", ["opt", "gpt_neox"])
def test_graph_discovered_split_trains_like_one_process(pool2, tmp_path, kind):
    """Architectures outside the policy table: the split found from the module graph trains
    through the engine (ZeRO-1, clipping active) equal to the unsplit model in one process."""
    seed = int(torch.randint(2**31, ()))
    results = pool2.run(
        jobs.trains_like_one_process, kind, 1, 0.05, seed, str(tmp_path), timeout=600.0
    )
    for rank, result in enumerate(results):
        where = (rank, seed, result)
        assert result["names_equal"] and result["moved"] > 1e-4, where
        assert result["weight_diff"] <= 1e-5 and result["output_diff"] <= 1e-5, where
        for pair in result["losses"] + result["norms"]:
            assert _relative(pair) <= 1e-5, where
        split = result["split"]
        if kind == "opt":
            layer = "model.decoder.layers.1"
            assert split[f"{layer}.self_attn.q_proj"] == ("LinearLayer", (16, 32)), where
            assert split[f"{layer}.self_attn.out_proj"] == ("LinearAllreduce", (32, 16)), where
            assert split[f"{layer}.fc1"] == ("LinearLayer", (32, 32)), where
            assert split[f"{layer}.fc2"] == ("LinearAllreduce", (32, 32)), where
            assert len(split) == 12, where  # lm_head tied to embed_tokens: kept whole
        else:
            layer = "gpt_neox.layers.0"
            assert split[f"{layer}.attention.query_key_value"] == ("LinearLayer", (48, 32))
            assert split[f"{layer}.attention.dense"] == ("LinearAllreduce", (32, 16)), where
            assert split["lm_head"] == ("LinearLayer", (32, 32)), where  # vocabulary split
            assert len(split) == 9, where


def test_graph_discovery_agrees_with_the_policy_table():
    """On the table's architectures the module graph gives the table's column/row split."""
    from deepspeed_cpp.module_inject.graph_discovery import discover_policy
    from deepspeed_cpp.module_inject.tp_policies import policy_for_model_type

    for kind, count in (("gpt2", 4), ("llama", 14)):
        model = jobs.tiny_model(kind)
        discovered, table = discover_policy(model), policy_for_model_type(kind)
        kinds = [(n, discovered.kind_of(n), table.kind_of(n)) for n, _ in model.named_modules()]
        if kind == "gpt2":
            # c_attn's fused [q | k | v] blocks: shapes cannot tell their layout, so the
            # attention stays whole; the MLP is split as the table splits it.
            assert all(ours is None for n, ours, _ in kinds if ".attn." in n), kinds
            kinds = [k for k in kinds if ".attn." not in k[0]]
        assert all(ours == theirs for _, ours, theirs in kinds), kinds
        assert sum(ours is not None for _, ours, _ in kinds) == count, kinds
    assert discover_policy(torch.nn.Sequential(torch.nn.Linear(4, 4))) is None
