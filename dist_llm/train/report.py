"""report.md: one page about a finished run, rebuilt from its files alone (`dist-llm report RUN_DIR`).

It reads config.yaml and metrics.jsonl (the start record, the memory record of the first step, the last
training and validation records) and links loss.png. Sizes are in binary units (KiB, MiB, GiB); tokens/s is
given twice, the run's average and the last log window's; a PEFT run's trainable share is counted from the
config against the whole model (a QLoRA base by its weights, with how they are stored).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from dist_llm.config import Config, ConfigError, config_from_dict
from dist_llm.fileio import atomic_write_text
from dist_llm.train.metrics import read_metrics

#: dense bf16 peak FLOP/s of devices we know, for MFU (name fragment -> FLOP/s)
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10G": 125e12}


def human_size(n: float | None) -> str:
    """Bytes in the largest binary unit that keeps the number at 1 or more: 812 B, 12.5 MiB, 1.25 GiB."""
    if n is None:
        return "-"
    value, unit = float(n), "B"
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
    # compare what will be printed, not the value: 1023.9 KiB would print as "1024 KiB", which is 1.00 MiB
    while unit != units[-1] and abs(float(_digits(value, unit))) >= 1024:
        value, unit = value / 1024, units[units.index(unit) + 1]
    return f"{_digits(value, unit)} {unit}"


def _digits(value: float, unit: str) -> str:
    """Three significant digits for a unit's number (bytes as an integer)."""
    if unit == "B":
        return f"{round(value)}"
    # chosen by the rounded number: 9.996 prints "10.0", not "10.00"; 99.96 prints "100", not "100.0"
    return (f"{value:.2f}" if abs(round(value, 2)) < 10 else f"{value:.1f}" if abs(round(value, 1)) < 100
            else f"{value:.0f}")


def human_duration(seconds: float) -> str:
    """45.2 s, 3m 08s, 2h 05m 09s."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    return f"{minutes // 60}h {minutes % 60:02d}m {secs:02d}s"


def run_average(train: list[dict[str, Any]], tokens_per_step: int) -> tuple[int, float] | None:
    """(tokens trained, seconds of training wall time) up to the last training record, resumes added up; None
    before any time was recorded. Their ratio is the run's average tokens/s, in the report and the run's summary."""
    if not train or not train[-1].get("elapsed_s"):
        return None
    return train[-1]["step"] * tokens_per_step, train[-1]["elapsed_s"]


def throughput_lines(train: list[dict[str, Any]], tokens_per_step: int) -> list[str]:
    """The run's average tokens/s (all its tokens over its training wall time, resumes added up) and the last
    log window's, each labelled: under a varying load the two can differ tenfold."""
    last = train[-1]
    lines = []
    average = run_average(train, tokens_per_step)
    if average:
        tokens, seconds = average
        lines.append(f"- tokens/s, run average: {tokens / seconds:,.0f} ({tokens:,} tokens in "
                     f"{seconds:,.1f} s of training wall time, evaluation and checkpoints included)")
    first = train[-2]["step"] + 1 if len(train) > 1 else 1
    lines.append(f"- tokens/s, last window: {last.get('tokens_per_s', 0.0):,.0f} (steps {first}-{last['step']}, "
                 f"evaluation and checkpoints not counted)")
    return lines


def peft_lines(cfg: Config) -> list[str]:
    """What a PEFT run trains against the whole model, counted on the meta device from the config: a QLoRA base
    weight counts as the elements it stands for, and how it is stored is said."""
    if cfg.peft.method == "none":
        return []
    from dist_llm.peft import planned_counts  # (builds a model: only for PEFT reports)
    from dist_llm.peft.nf4 import nf4_nbytes

    counts = planned_counts(cfg.model, cfg.peft)
    lines = [f"- peft {cfg.peft.method}: {counts.trainable:,} trainable parameters of {counts.total:,} "
             f"({100 * counts.trainable / max(1, counts.total):.2f}%), the base frozen"]
    if counts.nf4_shapes:
        n = sum(rows * cols for rows, cols in counts.nf4_shapes)
        stored = sum(nf4_nbytes(rows * cols) for rows, cols in counts.nf4_shapes)
        lines.append(f"- {n:,} of them, the blocks' linear weights, stored in NF4: 4-bit codes with an int8 scale "
                     f"per 64 and an fp32 factor per 256 scales, {human_size(stored)} "
                     f"({8 * stored / max(1, n):.3f} bits a weight) against {human_size(4 * n)} in fp32")
    return lines


def build_report(run_dir: Path) -> str:
    cfg_file, metrics_file = run_dir / "config.yaml", run_dir / "metrics.jsonl"
    for f in (cfg_file, metrics_file):
        if not f.is_file():
            raise ConfigError(f"report: {f} not found (is {run_dir} a run directory?)")
    cfg = _run_config(cfg_file)
    records = read_metrics(metrics_file)
    start = next((r for r in reversed(records) if r.get("event") == "start"), {})
    mem = next((r for r in reversed(records) if r.get("event") == "memory"), None)
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r and "loss" not in r]
    last: dict[str, Any] = train[-1] if train else {}
    layout = start.get("layout", {})
    p, t = cfg.parallel, cfg.train
    lines = [f"# Run report: {cfg.name}", "",
             "## Layout", "",
             f"- world size {layout.get('world_size', '?')}: dp {layout.get('dp', '?')} x cp {layout.get('cp', 1)} x "
             f"pp {layout.get('pp', '?')} x tp {layout.get('tp', '?')} (mesh order dp, cp, pp, tp)"
             + (f", ep {layout['ep']} (experts split over ep of the dp ranks)" if "ep" in layout else "")
             + f", zero_stage {p.zero_stage}, backend {p.backend}"
             + (f", {p.pp_schedule} schedule" if p.pp > 1 else "")
             + (", sequence parallel" if p.sequence_parallel else ""),
             f"- device {start.get('device', '?')}, precision {t.precision}, activation checkpointing "
             f"{t.activation_checkpointing}, peft {cfg.peft.method}",
             f"- {start.get('n_params', 0) / 1e6:.2f}M parameters; global batch {t.global_batch_size} x "
             f"{cfg.model.block_size} tokens in {start.get('accum_steps', '?')} micro-step(s) of {t.micro_batch_size}",
             *peft_lines(cfg), ""]
    lines += ["## Memory per rank (rank 0)", ""]
    if mem:
        pr, me = mem["predicted"], mem["measured"]
        lines += ["| | predicted | measured |", "|---|---|---|"]
        for key, label in [("params_bytes", "parameters"), ("grads_bytes", "gradients"), ("master_bytes", "fp32 master"),
                           ("optimizer_bytes", "optimizer states"), ("model_states_bytes", "model states"),
                           ("activation_bytes", "saved activations"), ("peak_bytes", "peak")]:
            lines.append(f"| {label} | {human_size(pr.get(key))} | {human_size(me.get(key))} |")
        lines += ["", "Measured: the bytes of the tensors the rank holds after its first step; saved activations "
                  "counted with saved_tensors_hooks during that step; the peak is the CUDA allocator's on a GPU.", ""]
    else:
        lines += ["(no memory record: the run stopped before its first step ended)", ""]
    lines += ["## Throughput and communication", ""]
    if last:
        tps = last.get("tokens_per_s", 0.0)
        lines += throughput_lines(train, t.global_batch_size * cfg.model.block_size)
        flops = start.get("flops_per_token")
        device = str(start.get("device", ""))
        if flops:
            lines.append(f"- model FLOPs, last window: {flops * tps / 1e12:.3f} TFLOP/s ({flops:.3g} per token)")
            peak = next((v for k, v in PEAK_BF16.items() if k in start.get("device_name", "")), None)
            if last.get("mfu") is not None:
                lines.append(f"- MFU: {100 * last['mfu']:.1f}% of the device's peak in the last window (the peak "
                             f"measured with a matmul at the start, or train.peak_tflops)")
            elif device.startswith("cuda") and peak:
                lines.append(f"- MFU: {100 * flops * tps / (peak * layout.get('world_size', 1)):.1f}% of "
                             f"{start.get('device_name')}'s bf16 datasheet peak in the last window")
            else:
                lines.append("- MFU: on a GPU, or with train.peak_tflops")
        if last.get("peak_memory_bytes"):
            lines.append(f"- peak memory per rank ({start.get('peak_memory', 'peak')}): "
                         + ", ".join(human_size(b) for b in last["peak_memory_bytes"][:16])
                         + (" ..." if len(last["peak_memory_bytes"]) > 16 else ""))
        comm = last.get("comm_bytes") or {}
        lines.append("- bytes sent per step by rank 0: " + (", ".join(f"{k} {human_size(v)}" for k, v in comm.items())
                                                            or "none"))
        lines.append(f"- last training loss {last['loss']:.4f}" + (f", validation loss {val[-1]['val_loss']:.4f} at step "
                                                                  f"{val[-1]['step']}" if val else ""))
    if cfg.train.plot:  # (a run with train.plot=false draws no image to link)
        lines += ["", "## Loss", "", "![loss](loss.png)", ""]
        if any("moe_imbalance" in r for r in train):
            lines += ["## Expert load", "", "![expert load](moe.png)", ""]
    return "\n".join(lines)


def _run_config(file: Path) -> Config:
    """A run's config.yaml (written by the run: rebuilt, not validated), or one line naming it."""
    try:
        tree = yaml.safe_load(file.read_text())
    except RecursionError:
        raise ConfigError(f"report: {file} is nested too deeply to be a config") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"report: {file} is not valid YAML ({str(e).splitlines()[0]})") from None
    try:
        return config_from_dict(tree, check=False)
    except ConfigError as e:
        raise ConfigError(f"report: {file}: {e}") from None


def summary_lines(run_dir: Path, *, step: int, stop: int, newest: Path | None, command: str) -> list[str]:
    """The few lines a run ends with on the console, from the same records as report.md: how far it got, its last
    losses, wall time and average tokens/s, where its files are, and `command` (the sample command) to try it."""
    cfg = _run_config(run_dir / "config.yaml")
    records = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r and "loss" not in r]

    def at(record: dict[str, Any]) -> str:  # (a stop between log steps: the last logged step's loss)
        return "" if record["step"] == step else f" at step {record['step']}"

    losses = [f"train loss {train[-1]['loss']:.4f}{at(train[-1])}"] if train else []
    losses += [f"val loss {val[-1]['val_loss']:.4f}{at(val[-1])}"] if val else []
    lines = [f"{'finished' if step >= stop else 'stopped'} at step {step} of {stop}" + (": " if losses else "")
             + ", ".join(losses)]
    average = run_average(train, cfg.train.global_batch_size * cfg.model.block_size)
    if average:
        tokens, seconds = average
        lines.append(f"  wall time {human_duration(seconds)} of training (evaluation and checkpoints included), "
                     f"{tokens / seconds:,.0f} tokens/s on average")
    where = [("checkpoints", run_dir / "checkpoints", f" (newest: {newest.name})" if newest else ""),
             ("report", run_dir / "report.md", "")]
    if cfg.train.plot:  # (with plots off, a loss.png there is an earlier run's: not this one's to name)
        where += [("loss plot", run_dir / "loss.png", "")]
        if any("moe_imbalance" in r for r in train):  # (a dense run's out_dir may hold an earlier MoE run's)
            where += [("MoE plot", run_dir / "moe.png", "")]
    lines += [f"  {label + ':':<13}{path}{more}" for label, path, more in where if path.exists()]
    if newest:
        lines.append(f"  {'sample:':<13}{command}")
    return lines


def write_report(run_dir: Path) -> Path:
    out = run_dir / "report.md"
    atomic_write_text(out, build_report(run_dir))  # a rewrite (`dist-llm report`) never leaves half a page
    return out
