"""metrics.jsonl (one JSON object a line) and the loss.png drawn from it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsLog:
    """Appends JSON lines on the main rank; a no-op elsewhere."""

    def __init__(self, path: Path, *, enabled: bool, fresh: bool) -> None:
        self.path = path
        self._file = None
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "w" if fresh else "a")

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_losses(metrics_path: Path, png_path: Path) -> None:
    """Train and validation loss against step. A resumed run's lines override the earlier run's at the same step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train: dict[int, float] = {}
    val: dict[int, float] = {}
    for rec in read_metrics(metrics_path):
        if "loss" in rec and math.isfinite(rec["loss"]):
            train[rec["step"]] = rec["loss"]
        if "val_loss" in rec:
            val[rec["step"]] = rec["val_loss"]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    if train:
        ax.plot(*zip(*sorted(train.items())), label="train", linewidth=1.2)
    if val:
        ax.plot(*zip(*sorted(val.items())), "o-", label="val", linewidth=1.2, markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(metrics_path.parent.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
