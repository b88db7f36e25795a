"""Issue 18, item 13: report.md gives the run's average tokens/s and the last window's, each labelled; sizes in
readable units; a QLoRA run's trainable share against the whole model, its 4-bit base counted by weights."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from dist_llm.config import Config, ModelConfig, PeftConfig
from dist_llm.model import GPT
from dist_llm.peft import apply_peft, parameter_counts
from dist_llm.peft.nf4 import NF4Weight, nf4_nbytes
from dist_llm.train.report import build_report, human_size


def test_human_size() -> None:
    assert [human_size(n) for n in (0, 812, 1024, 12_900_000, 3 * 2**30 // 2, 700 * 2**30, None)] == [
        "0 B", "812 B", "1.00 KiB", "12.3 MiB", "1.50 GiB", "700 GiB", "-"]
    # just under a unit: the rounded number would read 1024 of the smaller one
    assert [human_size(n) for n in (1023.6, 2**20 - 100, 2**30 - 2**19)] == ["1.00 KiB", "1.00 MiB", "1.00 GiB"]
    # and three significant digits where rounding carries into the next decade
    assert [human_size(n) for n in (9.996 * 1024, 99.96 * 1024)] == ["10.0 KiB", "100 KiB"]


def write_run(folder: Path, cfg: Config, layout: dict[str, int] | None = None) -> None:
    folder.mkdir()
    (folder / "config.yaml").write_text(cfg.to_yaml())
    layout = layout or {"world_size": 1, "dp": 1, "tp": 1, "pp": 1}
    records = [{"event": "start", "step": 0, "n_params": 885888, "layout": layout,
                "device": "cpu", "accum_steps": 1, "flops_per_token": 6e6, "peak_memory": "host peak RSS"},
               {"event": "memory", "step": 1, "predicted": {"params_bytes": 3543552, "peak_bytes": 234817656},
                "measured": {"params_bytes": 3543552, "peak_bytes": None}}]
    # steps 10 and 20: 20 steps' tokens in 40 s overall, but the last window (steps 11-20) ran at 14,841 tokens/s
    records += [{"step": 10, "loss": 3.0, "tokens_per_s": 150.0, "elapsed_s": 30.0, "comm_bytes": {"all_reduce": 3 * 2**20}},
                {"step": 20, "loss": 2.5, "tokens_per_s": 14841.0, "elapsed_s": 40.0, "comm_bytes": {},
                 "peak_memory_bytes": [700 * 2**20]},
                {"step": 20, "val_loss": 2.4}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_report_labels_average_and_window_throughput_and_reads_sizes(tmp_path: Path) -> None:
    cfg = Config()
    cfg.model = ModelConfig(n_layer=4, n_head=4, n_embd=128, vocab_size=256, block_size=128)
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 32, 32
    write_run(tmp_path / "run", cfg)
    report = build_report(tmp_path / "run")
    assert ("- tokens/s, run average: 2,048 (81,920 tokens in 40.0 s of training wall time, evaluation and "
            "checkpoints included)") in report
    assert "- tokens/s, last window: 14,841 (steps 11-20, evaluation and checkpoints not counted)" in report
    assert "| parameters | 3.38 MiB | 3.38 MiB |" in report and "| peak | 224 MiB | - |" in report
    assert "- peak memory per rank (host peak RSS): 700 MiB" in report
    assert " GB" not in report and "0.0000" not in report


def test_the_report_layout_names_every_degree() -> None:
    """cp was missing from the report's layout line (a review): a dp 2 x cp 2 x tp 2 run read "world size 8: dp 2
    x tp 2 x pp 1" (as ParallelContext.layout() records cp and ep only where they are above 1)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cfg = Config()
        cfg.model = ModelConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=64)
        cfg.parallel.cp, cfg.parallel.tp, cfg.parallel.ep = 2, 2, 2
        write_run(Path(tmp) / "run", cfg, {"world_size": 8, "dp": 2, "tp": 2, "pp": 1, "cp": 2, "ep": 2})
        report = build_report(Path(tmp) / "run")
    assert ("- world size 8: dp 2 x cp 2 x pp 1 x tp 2 (mesh order dp, cp, pp, tp), ep 2 (experts split over ep of "
            "the dp ranks)") in report, report[:600]


def test_qlora_report_counts_the_4bit_base_by_its_weights(tmp_path: Path) -> None:
    cfg = Config()
    cfg.model = ModelConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=256, block_size=32, pos_emb="rope",
                            norm="rmsnorm", mlp="swiglu", bias=False)
    cfg.peft = PeftConfig(method="qlora", rank=8, alpha=16, targets=["qkv", "attn_out", "mlp_up", "mlp_down"])
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 32, 32
    write_run(tmp_path / "run", cfg)
    report = build_report(tmp_path / "run")
    # the real QLoRA model: its NF4 weights are buffers, so a plain sum over parameters would skip them
    model = GPT(cfg.model)
    dense = sum(p.numel() for p in model.parameters())
    apply_peft(model, cfg.peft, seed=0)
    counts = parameter_counts(model)
    naive = sum(p.numel() for p in model.parameters())
    assert counts.total == dense + counts.trainable and naive < counts.total
    linears = [(3 * 64, 64), (64, 64), (192, 64), (192, 64), (64, 192)] * 2  # qkv, proj, up, gate, down
    assert sorted(counts.nf4_shapes) == sorted(linears)
    assert (f"- peft qlora: {counts.trainable:,} trainable parameters of {counts.total:,} "
            f"({100 * counts.trainable / counts.total:.2f}%), the base frozen") in report
    n = sum(a * b for a, b in linears)
    stored = sum(NF4Weight.quantize(torch.randn(shape), 64, 256).nbytes for shape in linears)
    assert (f"- {n:,} of them, the blocks' linear weights, stored in NF4: 4-bit codes with an int8 scale per 64 "
            f"and an fp32 factor per 256 scales, {human_size(stored)} ({8 * stored / n:.3f} bits a weight) against "
            f"{human_size(4 * n)} in fp32") in report
    # plain LoRA: no NF4 line, the same trainable count
    lora = dataclasses.replace(cfg, peft=dataclasses.replace(cfg.peft, method="lora"))
    write_run(tmp_path / "lora", lora)
    assert f"{counts.trainable:,} trainable" in build_report(tmp_path / "lora")
    assert "NF4" not in build_report(tmp_path / "lora")


def test_nf4_byte_count_is_what_quantising_stores() -> None:
    for shape in [(64, 32), (96, 40), (1, 7), (256, 300)]:
        assert nf4_nbytes(shape[0] * shape[1]) == NF4Weight.quantize(torch.randn(shape), 64, 256).nbytes, shape
