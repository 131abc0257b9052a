"""CIFAR-10 for the example: the real data set when it is on disk, else a generated stand-in.

The real one is read with torchvision from ``--data-dir`` (the ``cifar-10-batches-py`` folder
that ``torchvision.datasets.CIFAR10(download=True)`` leaves there). Without it (machines with no
network), a generated data set of the same shape is used: 10 classes of 3x32x32 images, each
class a striped pattern with its own orientation and stripe frequency, tinted with a colour that
it shares with another class, overlaid with uninformative stripes of random orientation, with
random phase, contrast, brightness and heavy pixel noise. Colour alone narrows a class down to a
pair; the model has to learn the spatial structure. A small CNN gets far above chance (10%) in
a few minutes, but not instantly to 100%. The same seed gives the same images on every rank.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch.utils.data import Dataset, TensorDataset

CLASSES = ("plane", "car", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
IMAGE_SHAPE = (3, 32, 32)
GENERATED_SEED = 20240611
GENERATED_TRAIN_SIZE = 10000
GENERATED_TEST_SIZE = 2000
# Pixel noise (std) against a pattern of amplitude ~0.5: high enough that no single pixel tells
# the class, so the network has to pool evidence over the image.
NOISE_STD = 1.6


def real_cifar10_present(data_dir: str | Path) -> bool:
    """Whether ``data_dir`` holds CIFAR-10 in torchvision's format."""
    return (Path(data_dir) / "cifar-10-batches-py" / "batches.meta").is_file()


def load_real_cifar10(data_dir: str | Path, download: bool = False) -> tuple[Dataset, Dataset]:
    """(train, test) from torchvision, normalised to [-1, 1] as in the DeepSpeed tutorial."""
    import torchvision
    import torchvision.transforms as transforms

    transform = transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))]
    )
    train = torchvision.datasets.CIFAR10(
        root=str(data_dir), train=True, download=download, transform=transform
    )
    test = torchvision.datasets.CIFAR10(
        root=str(data_dir), train=False, download=download, transform=transform
    )
    return train, test


def _class_recipes(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per class: an RGB tint (shared by classes c and c+5), a stripe angle and a frequency."""
    tints = torch.rand(5, 3, generator=generator) * 1.2 - 0.6
    tints = torch.cat([tints, tints])  # classes c and c+5 look alike in colour
    angles = torch.arange(10, dtype=torch.float32) * (math.pi / 10)
    frequencies = 1.5 + (torch.arange(10, dtype=torch.float32) * 7 % 10) * 0.45
    return tints, angles, frequencies


def _generate_split(count: int, generator: torch.Generator, recipes) -> TensorDataset:
    tints, angles, frequencies = recipes
    labels = torch.randint(0, 10, (count,), generator=generator)
    coordinates = torch.arange(32, dtype=torch.float32) / 32
    y, x = torch.meshgrid(coordinates, coordinates, indexing="ij")
    angle = angles[labels].view(-1, 1, 1)
    frequency = frequencies[labels].view(-1, 1, 1)
    phase = torch.rand(count, 1, 1, generator=generator) * 2 * math.pi
    stripes = torch.sin(
        2 * math.pi * frequency * (x * torch.cos(angle) + y * torch.sin(angle)) + phase
    )
    contrast = 0.3 + 0.4 * torch.rand(count, 1, 1, 1, generator=generator)
    brightness = 0.3 * torch.randn(count, 1, 1, 1, generator=generator)
    # A distractor: stripes of random angle and frequency that carry no information.
    distractor_angle = torch.rand(count, 1, 1, generator=generator) * math.pi
    distractor_frequency = 1.5 + 4 * torch.rand(count, 1, 1, generator=generator)
    distractor = torch.sin(
        2 * math.pi * distractor_frequency
        * (x * torch.cos(distractor_angle) + y * torch.sin(distractor_angle))
        + torch.rand(count, 1, 1, generator=generator) * 2 * math.pi
    )  # fmt: skip
    images = (
        tints[labels].view(count, 3, 1, 1)
        + contrast * stripes.unsqueeze(1)
        + 0.3 * distractor.unsqueeze(1)
        + brightness
    )
    images += NOISE_STD * torch.randn(count, *IMAGE_SHAPE, generator=generator)
    return TensorDataset(images.clamp_(-2.5, 2.5), labels)


def generated_cifar10(
    train_size: int = GENERATED_TRAIN_SIZE,
    test_size: int = GENERATED_TEST_SIZE,
    seed: int = GENERATED_SEED,
) -> tuple[TensorDataset, TensorDataset]:
    """(train, test) CIFAR-shaped data sets, identical for the same arguments on every rank."""
    generator = torch.Generator().manual_seed(seed)
    recipes = _class_recipes(generator)
    train = _generate_split(train_size, generator, recipes)
    test = _generate_split(test_size, generator, recipes)
    return train, test


def load_cifar10(data_dir: str | Path | None, download: bool = False):
    """(train, test, description): real CIFAR-10 when found (or downloaded), else generated."""
    if data_dir is not None and (download or real_cifar10_present(data_dir)):
        train, test = load_real_cifar10(data_dir, download=download)
        return train, test, f"CIFAR-10 from {str(data_dir)!r}"
    train, test = generated_cifar10()
    where = "no --data-dir given" if data_dir is None else f"not found in {str(data_dir)!r}"
    return (
        train,
        test,
        f"CIFAR-10 {where}: using a GENERATED CIFAR-shaped data set "
        f"({len(train)} train / {len(test)} test images, 10 classes, 3x32x32, seed "
        f"{GENERATED_SEED})",
    )
