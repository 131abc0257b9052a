"""Reads a run written by the csv_monitor or tensorboard monitor and draws its curves: the
engine's Train/Samples ones, then any ``Train/Eval/...`` scalar the script wrote itself through
``engine.monitor.write_events`` (a test accuracy per epoch, as the CIFAR-10 example does)."""

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
EVAL_PREFIX = "Train/Eval/"


def _read_csv_file(path: Path) -> tuple[str, list[tuple[float, float]]]:
    """The header's name and the ``(step, value)`` rows. A process that appends to a file it
    did not create (a resumed run) writes the ``step,<name>`` header again: those are skipped."""
    with open(path, newline="") as file:
        header, *rows = list(csv.reader(file))
    points = [(float(step), float(value)) for step, value in rows if [step, value] != header]
    return header[1], points


def _read_csv_run(folder: Path) -> dict[str, list[tuple[float, float]]]:
    curves = {}
    for event, _ in PANELS:
        path = folder / (event.replace("/", "_").replace(" ", "_") + ".csv")
        if path.exists():
            curves[event] = _read_csv_file(path)[1]
    # The file name lost the event's '/'s; the header keeps its last part (DeepSpeed's layout).
    for path in sorted(folder.glob("Train_Eval_*.csv")):
        name, points = _read_csv_file(path)
        curves[EVAL_PREFIX + name] = points
    return curves


def _read_tensorboard_run(folder: Path) -> dict[str, list[tuple[float, float]]]:
    if importlib.util.find_spec("tensorboard") is None:
        raise ImportError(f"{folder} holds TensorBoard event files: pip install tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    wanted = [event for event, _ in PANELS if event in tags]
    wanted += sorted(tag for tag in tags if tag.startswith(EVAL_PREFIX))
    return {
        event: [(float(point.step), float(point.value)) for point in accumulator.Scalars(event)]
        for event in wanted
    }


def read_run(run: str | Path) -> dict[str, list[tuple[float, float]]]:
    """``{event: [(samples, value), ...]}`` of the run's Train/Samples and Train/Eval curves."""
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


def plot_run(run: str | Path, output: str | Path | None = None, title: str | None = None) -> Path:
    """Draws the run's curves (one panel each, samples on the x axis) to ``output`` (default
    ``<run>.png``), under ``title`` if given; returns the path written."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ImportError("drawing needs matplotlib: pip install matplotlib")
    import matplotlib

    matplotlib.use("Agg")  # files only: no display is needed or wanted
    import matplotlib.pyplot as plt

    curves = read_run(run)
    shown = [(event, panel) for event, panel in PANELS if event in curves]
    shown += [
        (event, "eval: " + event[len(EVAL_PREFIX) :].replace("_", " "))
        for event in curves
        if event.startswith(EVAL_PREFIX)
    ]
    figure, axes = plt.subplots(len(shown), 1, figsize=(7, 2.6 * len(shown)), sharex=True)
    axes = [axes] if len(shown) == 1 else list(axes)
    for axis, (event, panel) in zip(axes, shown):
        samples, values = zip(*curves[event]) if curves[event] else ((), ())
        # An eval scalar is a few points (one per epoch): marked, or one point would not show.
        axis.plot(samples, values, marker="o" if event.startswith(EVAL_PREFIX) else None)
        axis.set_title(panel)
        axis.grid(alpha=0.3)
        if event.endswith("loss_scale"):
            axis.set_yscale("log", base=2)
    axes[-1].set_xlabel("samples")
    if title:
        figure.suptitle(title, fontsize=8)
    figure.tight_layout()
    target = Path(output) if output is not None else Path(str(Path(run).resolve()) + ".png")
    figure.savefig(target, dpi=100)
    plt.close(figure)
    return target
