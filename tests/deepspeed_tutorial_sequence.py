"""A training script making the DeepSpeed API calls of DeepSpeedExamples' CIFAR-10 script.

Our own script (not a copy): it touches the same API in the same order as
``training/cifar/cifar10_deepspeed.py`` of DeepSpeedExamples, with ``deepspeed`` replaced by
``deepspeed_cpp`` in the imports and the data set swapped for the generated one (no network):

- imports: ``deepspeed``, ``deepspeed.accelerator.get_accelerator``,
  ``deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer``;
- argparse with ``--local_rank``, ``--dtype {bf16,fp16,fp32}``, ``--stage {0,1,2,3}``, the MoE
  flags (``--moe``, ``--ep-world-size``, ``--num-experts``, ``--mlp-type``, ``--top-k``,
  ``--min-capacity``, ``--noisy-gate-policy``, ``--moe-param-group``) and
  ``deepspeed.add_config_arguments(parser)``;
- ``deepspeed.init_distributed()``, then ``torch.distributed.get_rank()`` / ``barrier()``;
- ``deepspeed.moe.layer.MoE(...)`` layers when ``--moe``, applied before ``fc3`` (their
  ``l_aux`` dropped, as there);
- a config *dict* with the same keys (including the deprecated ``zero_optimization.cpu_offload``
  and a disabled ``fp16`` block), passed as ``initialize(args=..., model=...,
  model_parameters=<filter or param groups>, training_data=..., config=...)``;
- ``get_accelerator().device_name(engine.local_rank)``, ``engine.bfloat16_enabled()``,
  ``engine.fp16_enabled()``, ``engine(inputs)``, ``engine.backward(loss)``, ``engine.step()``,
  ``engine.eval()`` and evaluation through ``engine(images)`` in the model's dtype.

Run by tests/test_cifar10_example.py through the launcher (one case) and in the session's pool of
2 gloo workers (the others, ``run_in_pool``); writes ``--out/rank<N>.json``.
"""

import argparse
import hashlib
import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import deepspeed_cpp as deepspeed
from deepspeed_cpp.accelerator import get_accelerator
from deepspeed_cpp.moe.utils import (
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
)

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "cifar10")
)
from cifar10_data import generated_cifar10  # noqa: E402 - found through the path above


def add_argument(argv=None):
    parser = argparse.ArgumentParser(description="CIFAR (DeepSpeedExamples' API sequence)")
    parser.add_argument("-e", "--epochs", default=1, type=int)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--dtype", default="fp16", type=str, choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--stage", default=0, type=int, choices=[0, 1, 2, 3])
    parser.add_argument("--moe", default=False, action="store_true")
    parser.add_argument("--ep-world-size", default=1, type=int)
    parser.add_argument("--num-experts", type=int, nargs="+", default=[1])
    parser.add_argument("--mlp-type", type=str, default="standard")
    parser.add_argument("--top-k", default=1, type=int)
    parser.add_argument("--min-capacity", default=0, type=int)
    parser.add_argument("--noisy-gate-policy", default=None, type=str)
    parser.add_argument("--moe-param-group", default=False, action="store_true")
    # Ours, for the test: a step limit and where to write the result.
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def get_ds_config(args):
    # The keys and values DeepSpeedExamples' script uses (its batch size and learning rates).
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000},
        },
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {
            "enabled": args.dtype == "fp16",
            "fp16_master_weights_and_grads": False,
            "loss_scale": 0,
            "loss_scale_window": 500,
            "hysteresis": 2,
            "min_loss_scale": 1,
            "initial_scale_power": 15,
        },
        "wall_clock_breakdown": False,
        "zero_optimization": {
            "stage": args.stage,
            "allgather_partitions": True,
            "reduce_scatter": True,
            "allgather_bucket_size": 50000000,
            "reduce_bucket_size": 50000000,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "cpu_offload": False,
        },
    }


class Net(nn.Module):
    """The tutorial's LeNet shape: two 5x5 convolutions, three linear layers."""

    def __init__(self, args):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.moe = args.moe
        if self.moe:
            self.experts = nn.ModuleList(
                deepspeed.moe.layer.MoE(
                    hidden_size=84,
                    expert=nn.Linear(84, 84),
                    num_experts=n,
                    ep_size=args.ep_world_size,
                    use_residual=args.mlp_type == "residual",
                    k=args.top_k,
                    min_capacity=args.min_capacity,
                    noisy_gate_policy=args.noisy_gate_policy,
                )
                for n in args.num_experts
            )
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc2(F.relu(self.fc1(x))))
        if self.moe:
            for layer in self.experts:
                x, _, _ = layer(x)
        return self.fc3(x)


def parameter_digest(module, dense_only=False):
    # Under ZeRO-3 the parameters are partitioned: gathered for the digest (a no-op otherwise).
    # ``dense_only``: without expert parameters (with ep_size > 1 they differ between ranks).
    params = [p for p in module.parameters() if not (dense_only and is_moe_param(p))]
    with deepspeed.zero.GatheredParameters(params):
        flat = torch.cat([p.detach().float().flatten() for p in params])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def main(args):
    deepspeed.init_distributed()
    if torch.distributed.get_rank() != 0:
        torch.distributed.barrier()
    trainset, testset = generated_cifar10(train_size=1000, test_size=200)
    if torch.distributed.get_rank() == 0:
        torch.distributed.barrier()

    net = Net(args)
    initial_digest = parameter_digest(net)
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    if args.moe_param_group:
        parameters = split_params_into_different_moe_groups_for_optimizer(
            {"params": [p for p in net.parameters()], "name": "parameters"}
        )
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(
        args=args,
        model=net,
        model_parameters=parameters,
        training_data=trainset,
        config=get_ds_config(args),
    )
    local_device = get_accelerator().device_name(model_engine.local_rank)
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half
    criterion = nn.CrossEntropyLoss()

    losses, step = [], 0
    for _ in range(args.epochs):
        for data in trainloader:
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
            step += 1
            if step == args.max_steps:
                break
        if step == args.max_steps:
            break

    testloader = torch.utils.data.DataLoader(testset, batch_size=4, shuffle=False)
    correct = total = 0
    model_engine.eval()
    with torch.no_grad():
        for images, labels in testloader:
            if target_dtype is not None:
                images = images.to(target_dtype)
            outputs = model_engine(images.to(local_device))
            _, predicted = torch.max(outputs.data, 1)
            total += labels.size(0)
            correct += (predicted == labels.to(local_device)).sum().item()

    result = {
        "rank": torch.distributed.get_rank(),
        "micro_batch": model_engine.train_micro_batch_size_per_gpu(),
        "bf16": model_engine.bfloat16_enabled(),
        "param_dtype": str(next(model_engine.module.parameters()).dtype),
        "losses": losses,
        "accuracy": correct / total,
        "test_total": total,
        "initial_parameters": initial_digest,
        "parameters": parameter_digest(model_engine.module),
        "dense_parameters": parameter_digest(model_engine.module, dense_only=True),
    }
    with open(os.path.join(args.out, f"rank{result['rank']}.json"), "w") as handle:
        json.dump(result, handle)


def run_in_pool(argv: list[str]) -> None:
    """The script's run inside a worker of tests/dist_pool.py, whose process group stands in for
    the launcher's (init_distributed() finds it initialised, as under the launcher). The expert
    groups another job may have cached in this process are forgotten first."""
    from deepspeed_cpp.utils import groups

    groups._reset_for_tests()
    main(add_argument(argv))


if __name__ == "__main__":
    main(add_argument())
