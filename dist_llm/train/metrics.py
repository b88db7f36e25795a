"""metrics.jsonl (one JSON object a line) and the loss.png drawn from it (and moe.png for an MoE run)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from dist_llm.config import ConfigError
from dist_llm.fileio import atomic_path, atomic_write_text


class MetricsLog:
    """Appends JSON lines on the main rank (a no-op elsewhere), and mirrors the numbers of each record with a
    step to TensorBoard (`tensorboard_dir`) and Weights & Biases (`wandb_mode` offline or online)."""

    def __init__(self, path: Path, *, enabled: bool, fresh: bool, tensorboard_dir: Path | None = None,
                 wandb_mode: str = "off", run_name: str = "", config: dict[str, Any] | None = None) -> None:
        self.path = path
        self._file = None
        self._tb: Any = None
        self._wandb: Any = None
        if not enabled:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "w" if fresh else "a")
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError("train.tensorboard=true needs the tensorboard package (pip install tensorboard)") from None
            self._tb = SummaryWriter(log_dir=str(tensorboard_dir))
        if wandb_mode != "off":
            try:
                import wandb
            except ImportError:
                raise ConfigError(f"train.wandb={wandb_mode} needs the wandb package (pip install wandb)") from None
            self._wandb = wandb.init(project="dist_llm", name=run_name, dir=str(path.parent), mode=wandb_mode,
                                     config=config, reinit="finish_previous")

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        step = record.get("step")
        if step is None or record.get("event"):
            return
        numbers: dict[str, float] = {}
        for k, v in record.items():
            if k != "step" and _number(v):
                numbers[k] = float(v)
            elif isinstance(v, list) and v and all(_number(x) for x in v):  # (moe_layer_imbalance: k/0, k/1, ...)
                numbers.update({f"{k}/{i}": float(x) for i, x in enumerate(v)})
        if self._tb is not None:
            for k, v in numbers.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def truncate_after(path: Path, step: int) -> int:
    """Drop the records of metrics.jsonl after `step`: a run resumed from that step's checkpoint writes them again,
    and the file should read as one run. The kept lines are written to a temporary file renamed over the old one,
    so a crash leaves the old file or the new, never half of one. A torn last line (a run killed mid-write) is
    dropped too. Returns how many lines were dropped. Call it on the main rank only."""
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    kept = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # (nested past the recursion limit: not one of ours)
            if i < len(lines) - 1:  # not a torn end: a line someone else wrote, not ours to drop
                kept.append(line)
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step", 0), int) or record.get("step", 0) <= step:
            kept.append(line)
    dropped = len(lines) - len(kept)
    if dropped:
        atomic_write_text(path, "".join(f"{line}\n" for line in kept))
    return dropped


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of metrics.jsonl; a line that is not a JSON object (a torn end, a note added by hand) is
    skipped, so the plot and the report still come out."""
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # (nested past the recursion limit: not one of ours)
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, png_path: Path) -> None:
    import matplotlib.pyplot as plt

    try:
        with atomic_path(png_path) as tmp:  # a resumed run redraws it: a failed draw keeps the previous plot
            fig.savefig(tmp, format="png")  # the temporary name has no .png to infer the format from
    finally:
        plt.close(fig)


MOE_PLOT = "moe.png"


def imbalance_lines(records: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    """The imbalance curves of moe.png, label -> {step: value}: "block b" for each MoE layer in block order
    (`moe_layer_imbalance`, its blocks from the start record's `moe_blocks`; "MoE layer i", the i-th MoE layer, where
    a run logged before that field), then "max over layers" (`moe_imbalance`). A resumed run's records override the
    earlier run's at the same step."""
    lines: dict[str, dict[int, float]] = {}
    worst: dict[int, float] = {}
    blocks: list[int] = []
    for rec in records:
        if rec.get("event") == "start":
            blocks = rec.get("moe_blocks") or []
        for i, value in enumerate(rec.get("moe_layer_imbalance") or []):
            if math.isfinite(value):
                label = f"block {blocks[i]}" if i < len(blocks) else f"MoE layer {i}"
                lines.setdefault(label, {})[rec["step"]] = value
        if "moe_imbalance" in rec and math.isfinite(rec["moe_imbalance"]):
            worst[rec["step"]] = rec["moe_imbalance"]
    return {**lines, "max over layers": worst} if worst else lines


def plot_moe(metrics_path: Path, png_path: Path) -> bool:
    """An MoE run's expert load against step: each MoE layer's imbalance (max/mean tokens per expert; 1 is perfect
    balance) and the worst layer's above, the aux loss and the dropped-token fraction below. Nothing for a dense
    run's metrics (no moe_imbalance): returns whether it drew."""
    records = read_metrics(metrics_path)
    imbalance = imbalance_lines(records)
    if "max over layers" not in imbalance:
        return False
    series: dict[str, dict[int, float]] = {"moe_aux_loss": {}, "moe_dropped_fraction": {}}
    for rec in records:
        for key, points in series.items():
            if key in rec and math.isfinite(rec[key]):
                points[rec["step"]] = rec[key]
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), dpi=100, sharex=True)
    for label, points in imbalance.items():
        worst = label == "max over layers"  # (drawn last, on top of the layers', thicker and black)
        top.plot(*zip(*sorted(points.items())), label=label, linewidth=1.6 if worst else 0.9,
                 **({"color": "black"} if worst else {"alpha": 0.8}))
    top.axhline(1.0, color="gray", linestyle="--", linewidth=0.8, label="balanced")
    top.set_ylabel("max / mean tokens per expert")
    top.set_title(f"{metrics_path.parent.name}: expert load")
    for key, label in (("moe_aux_loss", "aux loss"), ("moe_dropped_fraction", "dropped fraction")):
        if series[key]:
            bottom.plot(*zip(*sorted(series[key].items())), label=label, linewidth=1.2)
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    top.legend(fontsize="small", ncol=1 + len(imbalance) // 10)  # (a deep model's layers in a few columns)
    bottom.legend()
    fig.tight_layout()
    _save(fig, png_path)
    return True


def plot_losses(metrics_path: Path, png_path: Path) -> None:
    """Train and validation loss against step. A resumed run's lines override the earlier run's at the same step.
    An MoE run's expert load goes to moe.png beside it (`plot_moe`)."""
    plt = _pyplot()

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
    _save(fig, png_path)
    plot_moe(metrics_path, png_path.with_name(MOE_PLOT))
