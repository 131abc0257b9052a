"""Train a small CNN on CIFAR-10 with DeepSpeed's API; deepspeed_cpp runs it.

Written the way DeepSpeed's CIFAR-10 tutorial is used: argparse plus
``deepspeed.add_config_arguments``, ``deepspeed.initialize(args=..., model=...,
model_parameters=..., training_data=...)``, ``engine.backward(loss)``, ``engine.step()`` and
``get_accelerator()``. The only line that differs from a DeepSpeed version is the import of
``deepspeed_cpp as deepspeed`` (and of its accelerator).

Two processes on this machine, ZeRO stage 2::

    python -m deepspeed_cpp.launcher --num_procs 2 examples/cifar10/cifar10_deepspeed.py \\
        --deepspeed --deepspeed_config examples/cifar10/ds_config_zero2_fp32.json

Mixture of Experts, as the tutorial's ``run_ds_moe.sh`` (``run_ds_moe.sh`` here runs it through our
launcher): ``--moe --ep-world-size 2 --num-experts 2 --top-k 1 --noisy-gate-policy RSample
--moe-param-group`` puts MoE layers (linear experts) before the classifier, each rank holding
num_experts / ep_world_size of them.

Uses real CIFAR-10 from ``--data-dir`` when it is there (torchvision format), otherwise a
generated CIFAR-shaped data set (and says so). Prints the loss and the test accuracy, and writes
``metrics.json`` and ``loss_curve.png`` to ``--output-dir``.

The curves go through the engine's monitors, as a DeepSpeed user would record them: the engine
writes ``Train/Samples/train_loss`` and ``Train/Samples/lr`` at every step, the script adds
``Train/Eval/test_accuracy`` after each epoch (``engine.monitor.write_events``), and
``deepspeed_cpp.plot`` draws the PNG from the ``csv_monitor`` files. A config without a
``csv_monitor`` section of its own gets one writing to ``--output-dir/csv_monitor`` (and, with
``--tensorboard``, a ``tensorboard`` one writing to ``--output-dir/tensorboard``).
"""

import argparse
import json
import os
import shutil
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from cifar10_data import CLASSES, load_cifar10

import deepspeed_cpp as deepspeed
from deepspeed_cpp.accelerator import get_accelerator
from deepspeed_cpp.moe.utils import split_params_into_different_moe_groups_for_optimizer
from deepspeed_cpp.monitor.csv_monitor import csvMonitor


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="CIFAR-10 with the DeepSpeed API")
    parser.add_argument("-e", "--epochs", type=int, default=8, help="passes over the train set")
    parser.add_argument(
        "--max-steps", type=int, default=0, help="stop after this many optimizer steps (0: none)"
    )
    parser.add_argument(
        "--local_rank", type=int, default=-1, help="local rank passed by the launcher"
    )
    parser.add_argument(
        "--log-interval", type=int, default=50, help="print the loss every this many steps"
    )
    parser.add_argument(
        "--data-dir", default="./data", help="where CIFAR-10 is (torchvision's format)"
    )
    parser.add_argument(
        "--download", action="store_true", help="let torchvision download CIFAR-10 to --data-dir"
    )
    parser.add_argument(
        "--output-dir", default="runs/cifar10",
        help="where metrics.json, loss_curve.png and the monitors' files go",
    )  # fmt: skip
    parser.add_argument(
        "--tensorboard", action="store_true",
        help="also write TensorBoard event files (to --output-dir/tensorboard unless the config "
        "has its own tensorboard section)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=1234, help="seed of the initial weights")
    # The tutorial's MoE flags (DeepSpeedExamples' cifar10_deepspeed.py), with its defaults.
    parser.add_argument("--moe", action="store_true", help="use MoE layers before the classifier")
    parser.add_argument(
        "--ep-world-size", type=int, default=1, help="expert-parallel world size (ep_size)"
    )
    parser.add_argument(
        "--num-experts", type=int, nargs="+", default=[1], help="experts per MoE layer (a list)"
    )
    parser.add_argument(
        "--mlp-type", default="standard", choices=["standard", "residual"],
        help="residual: DeepSpeed's Residual MoE (a dense MLP beside the experts)",
    )  # fmt: skip
    parser.add_argument("--top-k", type=int, default=1, help="experts per token: 1 or 2")
    parser.add_argument("--min-capacity", type=int, default=0, help="minimum expert capacity")
    parser.add_argument(
        "--noisy-gate-policy", default=None, choices=[None, "RSample", "Jitter"],
        help="noise in the gate (top-1 only)",
    )  # fmt: skip
    parser.add_argument(
        "--moe-param-group", action="store_true",
        help="optimizer param groups per expert group (DeepSpeed's MoE groups)",
    )  # fmt: skip
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    if args.epochs < 1:
        parser.error(f"--epochs is {args.epochs}; expected at least 1")
    if args.log_interval < 1:
        parser.error(f"--log-interval is {args.log_interval}; expected at least 1")
    return args


class Net(nn.Module):
    """Three 3x3 conv layers and a linear classifier: ~24k parameters, quick on two CPU cores.
    With ``args.moe``: one MoE layer per ``--num-experts`` entry (linear experts) between the
    features and the classifier, as the tutorial's network."""

    def __init__(self, args: argparse.Namespace | None = None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.conv3 = nn.Conv2d(32, 64, 3, padding=1)
        self.moe_layers = nn.ModuleList()
        if args is not None and args.moe:
            for num_experts in args.num_experts:
                self.moe_layers.append(
                    deepspeed.moe.layer.MoE(
                        hidden_size=64,
                        expert=nn.Linear(64, 64),
                        num_experts=num_experts,
                        ep_size=args.ep_world_size,
                        use_residual=args.mlp_type == "residual",
                        k=args.top_k,
                        min_capacity=args.min_capacity,
                        noisy_gate_policy=args.noisy_gate_policy,
                    )
                )
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.conv3(x))
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        for layer in self.moe_layers:
            x, _, _ = layer(x)  # (output, l_aux, exp_counts); the tutorial drops l_aux
        return self.fc(x)


def load_data(args):
    """Rank 0 reads (or downloads) first so that the others never see a half-written folder."""
    rank = dist.get_rank()
    if rank != 0:
        dist.barrier()
    trainset, testset, description = load_cifar10(args.data_dir, download=args.download)
    if rank == 0:
        dist.barrier()
        print(description, flush=True)
    return trainset, testset, description


def evaluate(model_engine, testset, local_device, target_dtype, batch_size=250):
    """Test accuracy over the whole test set, each rank scoring every world_size-th image."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    shard = torch.utils.data.Subset(testset, range(rank, len(testset), world_size))
    loader = torch.utils.data.DataLoader(shard, batch_size=batch_size, shuffle=False)
    correct_per_class = torch.zeros(10, dtype=torch.int64)
    total_per_class = torch.zeros(10, dtype=torch.int64)
    model_engine.eval()
    with torch.no_grad():
        for images, labels in loader:
            images = images.to(local_device)
            if target_dtype is not None:
                images = images.to(target_dtype)
            predicted = model_engine(images).argmax(dim=1).cpu()
            total_per_class += torch.bincount(labels, minlength=10)
            correct_per_class += torch.bincount(labels[predicted == labels], minlength=10)
    model_engine.train()
    # Collectives take tensors on the backend's device (NCCL: the GPU), as in DeepSpeed's example.
    counts = torch.stack([correct_per_class, total_per_class]).to(local_device)
    dist.all_reduce(counts)
    counts = counts.cpu()
    return counts[0], counts[1]


def with_monitors(args):
    """The config as a dict, with a csv_monitor section (the PNG is drawn from its files) and,
    with ``--tensorboard``, a tensorboard one, where the config does not enable its own; a
    section the user wrote is kept as it is. The folders of the sections added here are
    emptied first (rank 0): a new run replaces the last one's curves as it replaces its
    metrics.json, where the monitors themselves would append to them."""
    if args.deepspeed_config is None:
        return None  # deepspeed.initialize says what is missing
    with open(args.deepspeed_config) as handle:
        config = json.load(handle)
    for section, wanted in (("csv_monitor", True), ("tensorboard", args.tensorboard)):
        if wanted and not config.get(section, {}).get("enabled", False):
            config[section] = {"enabled": True, "output_path": args.output_dir, "job_name": section}
            if dist.get_rank() == 0:
                shutil.rmtree(os.path.join(args.output_dir, section), ignore_errors=True)
    return config


def csv_monitor_folder(model_engine):
    """Where the engine's csv_monitor writes (rank 0, which alone writes; None elsewhere)."""
    for monitor in getattr(model_engine.monitor, "monitors", []):
        if isinstance(monitor, csvMonitor):
            return monitor.log_dir
    return None


def write_outputs(output_dir, metrics, csv_folder):
    """metrics.json and, with matplotlib installed, ``loss_curve.png``: the monitors' curves
    drawn by ``deepspeed_cpp.plot`` (the package does not depend on matplotlib: a wheel user may
    not have it; ``python -m deepspeed_cpp.plot`` draws it later from the same files)."""
    from deepspeed_cpp.plot import plot_run

    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "metrics.json"), "w") as handle:
        json.dump(metrics, handle, indent=1)
    png = os.path.join(output_dir, "loss_curve.png")
    try:
        plot_run(csv_folder, png, title=f"{metrics['data']}\n{metrics['config']}")
    except ImportError:
        print(
            f"matplotlib is not installed: {png} not drawn (pip install matplotlib; then "
            f"python -m deepspeed_cpp.plot {csv_folder} -o {png}); "
            f"wrote {output_dir}/metrics.json and the curves to {csv_folder}"
        )
        return
    print(f"wrote {png} (from {csv_folder}) and metrics.json")


def main(args):
    started = time.perf_counter()
    deepspeed.init_distributed()
    trainset, testset, data_description = load_data(args)

    # The same seed on every rank gives every rank the same initial weights.
    torch.manual_seed(args.seed)
    net = Net(args)
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    if args.moe_param_group:
        parameters = split_params_into_different_moe_groups_for_optimizer(
            {"params": [p for p in net.parameters() if p.requires_grad], "name": "parameters"}
        )
    # The config file goes in as a dict with the monitor sections added (DeepSpeed, like
    # deepspeed_cpp, takes the config once: from args.deepspeed_config or from config=).
    config = with_monitors(args)
    engine_args = argparse.Namespace(**{**vars(args), "deepspeed_config": None})
    model_engine, optimizer, trainloader, lr_scheduler = deepspeed.initialize(
        args=engine_args if config is not None else args,
        model=net,
        model_parameters=parameters,
        training_data=trainset,
        config=config,
    )
    local_device = get_accelerator().device_name(model_engine.local_rank)
    is_logger = model_engine.global_rank == 0
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half
    if is_logger:
        print(
            f"{model_engine.world_size} process(es) on {local_device}, micro batch "
            f"{model_engine.train_micro_batch_size_per_gpu()}, gradient accumulation "
            f"{model_engine.gradient_accumulation_steps()}, dtype {target_dtype or torch.float32}",
            flush=True,
        )
    criterion = nn.CrossEntropyLoss()

    loss_curve, accuracy_per_epoch = [], []
    interval_loss = torch.zeros(1, dtype=torch.float64, device=local_device)
    interval_batches, step = 0, 0
    training_started = time.perf_counter()
    for epoch in range(args.epochs):
        for inputs, labels in trainloader:
            inputs, labels = inputs.to(local_device), labels.to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            # The loss in fp32 whatever the model's dtype: bf16 logits lose the small differences
            # that cross-entropy is made of.
            loss = criterion(outputs.float(), labels)
            model_engine.backward(loss)
            model_engine.step()
            step += 1
            interval_loss += loss.item()
            interval_batches += 1
            if step % args.log_interval == 0:
                dist.all_reduce(interval_loss)
                mean_loss = interval_loss.item() / (interval_batches * dist.get_world_size())
                loss_curve.append((step, mean_loss))
                if is_logger:
                    print(f"[epoch {epoch + 1}, step {step:5d}] loss: {mean_loss:.4f}", flush=True)
                interval_loss.zero_()
                interval_batches = 0
            if step == args.max_steps:
                break
        correct, total = evaluate(model_engine, testset, local_device, target_dtype)
        accuracy = correct.sum().item() / total.sum().item()
        accuracy_per_epoch.append(accuracy)
        # The script's own scalar beside the engine's curves (written by rank 0 only).
        model_engine.monitor.write_events(
            [("Train/Eval/test_accuracy", accuracy, model_engine.global_samples)]
        )
        if is_logger:
            print(
                f"epoch {epoch + 1}: test accuracy {100 * accuracy:.2f}% "
                f"({time.perf_counter() - training_started:.1f} s of training)",
                flush=True,
            )
        if step == args.max_steps:
            break

    training_seconds = time.perf_counter() - training_started
    if is_logger:
        print(f"Finished Training: {step} steps in {training_seconds:.1f} s")
        for name, right, count in zip(CLASSES, correct.tolist(), total.tolist()):
            print(f"Accuracy of {name:>5s}: {100 * right / max(count, 1):5.1f}%")
        print(
            f"Accuracy of the network on the {total.sum().item()} test images: "
            f"{100 * accuracy_per_epoch[-1]:.2f}% (chance: 10%)",
            flush=True,
        )
        write_outputs(
            args.output_dir,
            {
                "data": data_description,
                "config": args.deepspeed_config,
                "world_size": model_engine.world_size,
                "steps": step,
                "loss_curve": loss_curve,
                "test_accuracy_per_epoch": accuracy_per_epoch,
                "final_test_accuracy": accuracy_per_epoch[-1],
                "training_seconds": training_seconds,
                "total_seconds": time.perf_counter() - started,
            },
            csv_monitor_folder(model_engine),
        )


if __name__ == "__main__":
    main(parse_arguments())
