"""The tiny model, data and configs shared by the DeepSpeed checkpoint fixtures' generator
(``fixtures/deepspeed_checkpoints/make_fixtures.py``, run with real DeepSpeed) and the tests that
load those fixtures into deepspeed_cpp (``test_deepspeed_checkpoints.py``). Nothing here imports
either engine, so both sides train exactly the same thing."""

from __future__ import annotations

import torch

IN, HIDDEN, OUT = 7, 13, 3  # odd sizes: no partition divides a parameter evenly
GLOBAL_BATCH = 8
MODEL_SEED, OTHER_SEED = 1234, 98765  # OTHER_SEED: a resumed engine starts from other weights
LR, MIN_LR, WARMUP, BETAS, EPS, WEIGHT_DECAY = 1e-2, 1e-3, 5, (0.9, 0.99), 1e-8, 0.01
STEPS_BEFORE, STEPS_AFTER = 2, 2
CLIENT_STATE = {"epoch": 7, "note": "fixture", "seen": [1, 2, 3]}
# (name, ZeRO stage, dtype): bf16 at stage 1 is DeepSpeed's BF16_Optimizer (bf16_zero_* files).
FIXTURES = [
    ("zero1", 1, "fp32"),
    ("zero2", 2, "fp32"),
    ("zero3", 3, "fp32"),
    ("zero1_bf16", 1, "bf16"),
    ("zero2_fp16", 2, "fp16"),  # DeepSpeed's fp16 ZeRO optimizer and its dynamic loss scaler
    ("zero3_frozen", 3, "fp32"),  # fc1.weight frozen: its partitions sit in the model files
]
FROZEN = "fc1.weight"  # frozen in the fixtures whose name ends in "_frozen"


class TinyNet(torch.nn.Module):
    """A few hundred parameters, three layers of odd sizes and a buffer."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(IN, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, OUT)
        self.register_buffer("shift", torch.linspace(-0.5, 0.5, HIDDEN))

    def forward(self, x):
        h = torch.tanh(self.fc1(x)) + self.shift.to(x.dtype)  # bf16 runs keep the buffer fp32
        h = torch.tanh(self.fc2(h))
        return self.head(h)


def make_model(seed: int = MODEL_SEED, frozen: bool = False) -> TinyNet:
    torch.manual_seed(seed)
    model = TinyNet()
    if frozen:
        model.get_parameter(FROZEN).requires_grad_(False)
    return model


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of optimizer step ``step`` (0-based), the same for every world size."""
    generator = torch.Generator().manual_seed(1000 + step)
    return (
        torch.randn(GLOBAL_BATCH, IN, generator=generator),
        torch.randn(GLOBAL_BATCH, OUT, generator=generator),
    )


def rank_rows(rank: int, world: int) -> slice:
    micro = GLOBAL_BATCH // world
    return slice(rank * micro, (rank + 1) * micro)


def train(engine, first_step: int, steps: int) -> tuple[list[float], list[float]]:
    """Steps ``first_step`` .. on this rank's rows of the global batches; returns the losses and
    the learning rates each step used. The same loop for DeepSpeed's engine and ours."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = next(engine.module.parameters()).dtype
    losses, lrs = [], []
    for step in range(first_step, first_step + steps):
        x, y = global_batch(step)
        rows = rank_rows(rank, world)
        lrs.append(engine.get_lr()[0])
        loss = torch.nn.functional.mse_loss(engine(x[rows].to(dtype)).float(), y[rows])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, lrs


def ds_config(world: int, stage: int, dtype: str) -> dict:
    """The DeepSpeed config both engines train with (fixture side adds nothing but this)."""
    config = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1000,
        "gradient_clipping": 1.0,  # DeepSpeed 0.19's default, said out loud for both engines
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": MIN_LR,
                "warmup_max_lr": LR,
                "warmup_num_steps": WARMUP,
                "warmup_type": "linear",
            },
        },  # fmt: skip
        "zero_optimization": {"stage": stage},
    }
    if stage == 3:
        # Every parameter partitioned (none kept whole as "persistent").
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    if dtype == "fp16":
        # A small first scale; the window outlasts the 4 steps: on the step where the dynamic
        # scale grows, DeepSpeed 0.19.8's ZeRO 1/2 unscale the gradients by the grown scale
        # (stage_1_and_2.py: _update_scale before unscale_and_clip_grads), halving that step's
        # gradients, which deepspeed_cpp does not copy; the fixture compares checkpoints, not that.
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 100}
    return config


# --- the MoE fixture: one MoE layer of 2 experts, expert parallel over the 2 ranks ------------
MOE_FIXTURE = ("zero2_moe", 2, "fp32")
NUM_EXPERTS, EP_SIZE = 2, 2


class TinyMoENet(torch.nn.Module):
    """TinyNet with its middle layer made a MoE layer (``moe_class``: DeepSpeed's or ours, the
    same signature): top-1 gating without random token selection or noise, and a capacity of
    every token a rank sees (capacity_factor = num_experts), so the forward pass draws no random
    numbers and drops nothing."""

    def __init__(self, moe_class):
        super().__init__()
        self.fc1 = torch.nn.Linear(IN, HIDDEN)
        self.moe = moe_class(
            HIDDEN, torch.nn.Linear(HIDDEN, HIDDEN), num_experts=NUM_EXPERTS, ep_size=EP_SIZE,
            k=1, capacity_factor=float(NUM_EXPERTS), min_capacity=0, use_rts=False,
        )  # fmt: skip
        self.head = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        h, _, _ = self.moe(h)
        return self.head(torch.tanh(h))


def make_moe_model(moe_class, seed: int = MODEL_SEED) -> TinyMoENet:
    torch.manual_seed(seed)
    return TinyMoENet(moe_class)


# --- the AutoTP fixture: DeepSpeed's tensor-parallel training (autotp_size 2) ------------------
# ZeRO 1, fp32, 2 ranks: tensor parallel 2 x data parallel 1, so each rank writes its own
# mp_rank_XX model-states file and its optimizer partition. A Llama (q/k/v/gate/up split by
# output rows, o/down by input columns, the untied lm_head by vocabulary, embeddings and norms
# whole) small enough to keep the files at a few tens of KB.
TP_FIXTURE = ("autotp2_zero1", 1, "fp32")
TP_SIZE, TP_BATCH, TP_SEQUENCE, TP_VOCAB = 2, 4, 8, 32


def make_tp_model(seed: int = MODEL_SEED):
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=TP_VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=TP_SEQUENCE,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def tp_batch(step: int) -> torch.Tensor:
    """The token ids of optimizer step ``step`` (0-based): the global batch."""
    generator = torch.Generator().manual_seed(2000 + step)
    return torch.randint(0, TP_VOCAB, (TP_BATCH, TP_SEQUENCE), generator=generator)


def tp_config(tp: int, dp: int) -> dict:
    """``ds_config`` at tensor-parallel size ``tp`` over ``dp`` data-parallel ranks."""
    config = ds_config(1, TP_FIXTURE[1], TP_FIXTURE[2])
    config["train_micro_batch_size_per_gpu"] = TP_BATCH // dp
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    return config


def tp_train(engine, first_step: int, steps: int, dp_rank: int, dp: int):
    """Steps ``first_step`` .. on this data-parallel rank's rows (the whole batch at DP 1);
    returns each step's loss and learning rate."""
    losses, lrs = [], []
    rows = TP_BATCH // dp
    for step in range(first_step, first_step + steps):
        ids = tp_batch(step)[dp_rank * rows : (dp_rank + 1) * rows]
        lrs.append(engine.get_lr()[0])
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, lrs
