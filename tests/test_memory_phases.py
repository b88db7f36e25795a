"""The per-phase peak memory the trainer measures (dist_llm/train/memory_phases.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_llm import perf
from dist_llm.train.memory_phases import PhaseMeter
from tests.distributed import run_distributed
from tests.test_data_parallel import corpus, train  # noqa: F401 - corpus is a fixture
from tests.test_trainer import make_trainer

MiB = 2**20
CPU = torch.device("cpu")


def phases_event(out_dir: Path) -> dict[str, Any]:
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("event") == "memory_phases"][-1]  # (a resumed run appends)


def test_each_phase_has_its_own_peak() -> None:
    meter = PhaseMeter(CPU)
    meter.end("startup")
    base = perf.memory_bytes(CPU)
    big = torch.ones(64 * MiB // 4)  # 64 MiB, written so its pages are resident
    del big
    meter.end("step1")
    meter.end("save")  # nothing allocated in it
    host_step1, host_save = meter.peaks["step1"][0], meter.peaks["save"][0]
    # the 64 MiB are gone before the step ends, yet its peak holds them; the next phase's peak does not
    assert host_step1 - base >= 60 * MiB
    assert host_save - base < 32 * MiB  # (a margin for the allocator's own pages)
    assert meter.per_phase and meter.training_peak() >= host_step1  # training's peak spans the boundaries


def test_without_clear_refs_the_running_peak_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(perf, "reset_peak_memory", lambda device: False)
    meter = PhaseMeter(CPU)
    big = torch.ones(64 * MiB // 4)
    del big
    meter.end("startup")
    meter.end("step1")
    assert not meter.per_phase
    assert meter.peaks["step1"][0] >= meter.peaks["startup"][0]  # one running peak, never reset
    event = meter.event(_OneProcess(), step=1)
    assert event["host_peak"] == "running (clear_refs not writable)"


class _OneProcess:
    world_size, pp_rank, cpu_group = 1, 0, None


def test_the_trainer_writes_every_phase_of_a_run_and_its_resume(tmp_path: Path, corpus_file: Path) -> None:
    out = tmp_path / "run"
    make_trainer(out, corpus_file, train__max_steps=3, train__eval_interval=0).fit()
    first = phases_event(out)
    assert first["phases"] == ["startup", "step1", "train", "save"] and first["step"] == 3
    assert first["host_peak"] == "per phase" and first["pp_rank"] == [0]
    (idle,) = first["rss_at_start_bytes"]
    assert 50 * MiB < idle < 4 * 2**30  # a Python process with torch and dist_llm imported
    for phase, (peak,) in first["rank_peaks"]["host"].items():
        # every phase's peak lies above the resident set of an idle rank (less what a trim gave back) and far
        # below a GiB more: the model is 2 layers of 32
        assert idle - 64 * MiB < peak < idle + 1024 * MiB, phase
    assert "cuda" not in first["rank_peaks"]
    make_trainer(out, corpus_file, train__max_steps=4, train__eval_interval=0, train__resume="auto").fit()
    second = phases_event(out)
    assert second["phases"] == ["startup", "resume", "step1", "save"] and second["step"] == 4


def test_every_rank_reports_its_phases(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    run_distributed(train, 2, tmp_path, corpus, {"parallel__pp": 2, "train__max_steps": 2}, init_group=False)
    event = phases_event(tmp_path)
    assert event["pp_rank"] == [0, 1] and len(event["rss_at_start_bytes"]) == 2
    assert event["phases"] == ["startup", "step1", "train", "save"]
    for phase, peaks in event["rank_peaks"]["host"].items():
        assert len(peaks) == 2 and min(peaks) > 50 * MiB, phase

