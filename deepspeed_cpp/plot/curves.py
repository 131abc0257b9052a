"""Reads a run written by the csv_monitor or tensorboard monitor and draws its curves."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

# The panels, in order, and the event each one shows (DeepSpeed's names).
PANELS = (
    ("Train/Samples/train_loss", "training loss"),
    ("Train/Samples/lr", "learning rate"),
    ("Train/Samples/loss_scale", "loss scale"),
)


def _read_csv_run(folder: Path) -> dict[str, list[tuple[float, float]]]:
    curves = {}
    for event, _ in PANELS:
        path = folder / (event.replace("/", "_").replace(" ", "_") + ".csv")
        if path.exists():
            with open(path, newline="") as file:
                rows = list(csv.reader(file))[1:]  # the header is step,<name>
            curves[event] = [(float(step), float(value)) for step, value in rows]
    return curves


def _read_tensorboard_run(folder: Path) -> dict[str, list[tuple[float, float]]]:
    if importlib.util.find_spec("tensorboard") is None:
        raise ImportError(f"{folder} holds TensorBoard event files: pip install tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    return {
        event: [(float(point.step), float(point.value)) for point in accumulator.Scalars(event)]
        for event, _ in PANELS
        if event in tags
    }


def read_run(run: str | Path) -> dict[str, list[tuple[float, float]]]:
    """``{event: [(samples, value), ...]}`` of the run's Train/Samples curves."""
    folder = Path(run)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder (give output_path/job_name)")
    if any(folder.glob("events.out.tfevents.*")):
        curves = _read_tensorboard_run(folder)
    else:
        curves = _read_csv_run(folder)
    if not curves:
        raise ValueError(f"{folder} holds no Train/Samples curves (csv_monitor or tensorboard)")
    return curves


def plot_run(run: str | Path, output: str | Path | None = None) -> Path:
    """Draws the run's curves (one panel each, samples on the x axis) to ``output`` (default
    ``<run>.png``); returns the path written."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ImportError("drawing needs matplotlib: pip install matplotlib")
    import matplotlib

    matplotlib.use("Agg")  # files only: no display is needed or wanted
    import matplotlib.pyplot as plt

    curves = read_run(run)
    shown = [(event, title) for event, title in PANELS if event in curves]
    figure, axes = plt.subplots(len(shown), 1, figsize=(7, 2.6 * len(shown)), sharex=True)
    axes = [axes] if len(shown) == 1 else list(axes)
    for axis, (event, title) in zip(axes, shown):
        samples, values = zip(*curves[event]) if curves[event] else ((), ())
        axis.plot(samples, values)
        axis.set_title(title)
        axis.grid(alpha=0.3)
        if event.endswith("loss_scale"):
            axis.set_yscale("log", base=2)
    axes[-1].set_xlabel("samples")
    figure.tight_layout()
    target = Path(output) if output is not None else Path(str(Path(run).resolve()) + ".png")
    figure.savefig(target, dpi=100)
    plt.close(figure)
    return target
