"""The GPU path's parts, checked on the CPU: batch prefetching, the SDPA kernel check, MFU and peak memory."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from dist_llm import perf
from dist_llm.config import ModelConfig
from dist_llm.data import BatchPrefetcher
from dist_llm.model import GPT
from dist_llm.train.report import human_size
from tests.distributed import run_distributed
from tests.test_data_parallel import corpus, train  # noqa: F401 - corpus is a fixture
from tests.test_trainer import losses, make_trainer


def test_prefetcher_builds_the_next_step_in_its_thread() -> None:
    threads: dict[int, str] = {}

    def load(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        threads[step] = threading.current_thread().name
        return [(torch.full((2,), step), torch.full((2,), -step))]

    loader = BatchPrefetcher(load, enabled=True)
    for step in (0, 1, 2, 7, 8):  # 7 was not prefetched (a resume, say): built in the caller's thread
        (x, y), = loader.get(step)
        assert x.tolist() == [step, step] and y.tolist() == [-step, -step]
    loader.close()
    main = threading.current_thread().name
    assert threads[0] == main and threads[7] == main
    assert all(threads[s].startswith("dist_llm-data") for s in (1, 2, 8))

    sync = BatchPrefetcher(load, enabled=False)
    sync.get(3)
    assert threads[3] == main and 4 not in threads


def test_prefetching_changes_no_loss(tmp_path: Path, corpus_file: Path) -> None:
    kw = dict(train__max_steps=6, train__eval_interval=3)
    make_trainer(tmp_path / "on", corpus_file, data__prefetch=True, **kw).fit()
    make_trainer(tmp_path / "off", corpus_file, data__prefetch=False, **kw).fit()
    assert losses(tmp_path / "on") == losses(tmp_path / "off")


def test_sdpa_kernel_names_the_kernel_that_runs() -> None:
    cpu = torch.device("cpu")
    attention = GPT(ModelConfig()).train().blocks[0].attn
    for dtype in (torch.float32, torch.bfloat16):
        assert perf.sdpa_kernel(attention, seq=64, dtype=dtype, device=cpu) == "flash-cpu"
    with sdpa_kernel(SDPBackend.MATH):  # the fallback that materialises the scores
        assert perf.sdpa_kernel(attention, seq=64, dtype=torch.float32, device=cpu) == "math"
    # a bias mask (ALiBi) has no fused CPU kernel in training
    alibi = GPT(ModelConfig(pos_emb="alibi")).train().blocks[0].attn
    assert perf.sdpa_kernel(alibi, seq=64, dtype=torch.float32, device=cpu) == "math"


def test_sdpa_kernel_check_draws_nothing_from_the_random_streams() -> None:
    attention = GPT(ModelConfig(dropout=0.1)).train().blocks[0].attn  # dropout draws from the generator
    before = torch.random.get_rng_state()
    perf.sdpa_kernel(attention, seq=32, dtype=torch.float32, device=torch.device("cpu"))
    assert torch.equal(torch.random.get_rng_state(), before)


def test_metrics_carry_mfu_peak_memory_and_the_attention_kernel(tmp_path: Path, corpus_file: Path) -> None:
    out = tmp_path / "run"
    make_trainer(out, corpus_file, train__max_steps=3, train__eval_interval=0, train__peak_tflops=0.002).fit()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    header, steps = records[0], [r for r in records if "loss" in r]
    assert header["sdpa_kernel"] == "flash-cpu" and header["peak_memory"] == "host peak RSS"
    for r in steps:
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * header["flops_per_token"] / 2e9, rel=1e-3)
        (peak,) = r["peak_memory_bytes"]
        assert 50 * 2**20 < peak < 8 * 2**30  # a Python process with torch, and a tiny model
    report = (out / "report.md").read_text()
    assert f"- MFU: {100 * steps[-1]['mfu']:.1f}% of the device's peak" in report
    assert f"- peak memory per rank (host peak RSS): {human_size(steps[-1]['peak_memory_bytes'][0])}" in report
    # no peak given on a CPU: no mfu (a CPU's matmul peak says little about training on it)
    make_trainer(tmp_path / "plain", corpus_file, train__max_steps=1, train__eval_interval=0).fit()
    assert all("mfu" not in json.loads(line) for line in (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines())


def test_peak_memory_of_every_rank(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    (result, _) = run_distributed(train, 2, tmp_path, corpus, {"parallel__zero_stage": 2}, init_group=False)
    for record in result["records"]:
        assert len(record["peak_memory_bytes"]) == 2 and min(record["peak_memory_bytes"]) > 50 * 2**20


def test_peak_memory_follows_allocations() -> None:
    cpu = torch.device("cpu")
    perf.reset_peak_memory(cpu)
    base = perf.memory_bytes(cpu)
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, written so its pages are resident
    assert perf.peak_memory_bytes(cpu) - base >= 60 * 2**20
    del big
    perf.reset_peak_memory(cpu)
    assert perf.peak_memory_bytes(cpu) - base < 32 * 2**20


def test_peak_flops_and_mfu() -> None:
    # (measured in fit after a resume restored the RNG: on a GPU its random operands came from the global
    # generator, so every dropout mask after a resume differed from the uninterrupted run's)
    before = torch.random.get_rng_state()
    flops = perf.measure_peak_flops(torch.device("cpu"), torch.float32, n=256, repeats=2, rounds=1)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert 1e8 < flops < 1e14
    assert perf.mfu(tokens_per_s=1000.0, flops_per_token=6e6, peak_flops=1.2e10) == pytest.approx(0.5)


@pytest.mark.parametrize("stage, kind", [(0, "comm.all_reduce"), (2, "comm.reduce_scatter"), (3, "comm.reduce_scatter")])
def test_gradient_reduction_overlaps_backward(tmp_path: Path, corpus: Path, stage: int, kind: str) -> None:  # noqa: F811
    """The profiler trace of a step at dp=2 with small buckets: DDP's bucket all-reduces, ZeRO-2's bucket
    reduce-scatters and FSDP2's per-block reduce-scatters start while backward is still running, not after it."""
    run_distributed(train, 2, tmp_path, corpus, {"parallel__zero_stage": stage, "parallel__bucket_mb": 0.01,
                                                 "train__max_steps": 2, "train__profile_steps": "2:2"},
                    init_group=False)
    events = json.loads((tmp_path / "profile" / "rank_0.json").read_text())["traceEvents"]
    ranges = [e for e in events if e.get("ph") == "X"]
    (backward,) = [e for e in ranges if e["name"] == "backward"]
    end = backward["ts"] + backward["dur"]
    launched = [e for e in ranges if e["name"] == kind and backward["ts"] <= e["ts"] < end]
    assert len(launched) >= 2, f"{kind}: {len(launched)} launched inside backward"
    last_inside = max(e["ts"] + e["dur"] for e in launched)
    assert last_inside < end  # and backward went on computing after them
