"""`parallel.backend=deepspeed` against our own ZeRO-2 on 2 gloo ranks (fp32: the same losses to 1e-5)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed import run_distributed
from tests.test_data_parallel import STEPS, corpus, train  # noqa: F401 - corpus is a fixture


def test_deepspeed_zero2_matches_ours(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    extra = {"parallel__zero_stage": 2, "train__micro_batch_size": 2}  # 2 micro-steps per rank
    ours = run_distributed(train, 2, tmp_path / "ours", corpus, extra, init_group=False)[0]
    theirs = run_distributed(train, 2, tmp_path / "ds", corpus, {**extra, "parallel__backend": "deepspeed"},
                             init_group=False, timeout=600)[0]
    assert theirs["dp"] == "deepspeed"
    assert len(theirs["losses"]) == STEPS
    for a, b in zip(theirs["losses"], ours["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-5)
