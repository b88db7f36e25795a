"""`train.profile_steps=a:b`: a PyTorch profiler trace of steps a..b (Chrome trace JSON, one file per rank).

The trainer and the collectives name their parts with `span(...)` (forward, backward, grad_sync, clip,
optimizer, each `comm.<collective>`), so the trace shows which communication overlaps which compute. Outside
a profiled step `span` is a no-op: no profiler call on the hot path of an ordinary step.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterator

import torch
from torch.profiler import ProfilerActivity, profile, record_function

log = logging.getLogger("dist_llm")
_active = False  # True while a profiled step runs


def span(name: str) -> contextlib.AbstractContextManager:
    """A named range in the trace while profiling; nothing otherwise."""
    return record_function(name) if _active else contextlib.nullcontext()


class StepProfiler:
    """Profiles the steps of `steps` (a, b): `around(step)` wraps one training step; after step b the trace
    is written to `out_dir/profile/rank_K.json`."""

    def __init__(self, steps: tuple[int, int] | None, out_dir: Path, rank: int, device: torch.device) -> None:
        self.steps, self.rank = steps, rank
        self.path = out_dir / "profile" / f"rank_{rank}.json"
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self._prof: profile | None = None

    @contextlib.contextmanager
    def around(self, step: int) -> Iterator[None]:
        """`step` is the number the step will have once done (1 for the first)."""
        global _active
        if self.steps is None or not self.steps[0] <= step <= self.steps[1]:
            yield
            return
        if self._prof is None:
            self._prof = profile(activities=self.activities, record_shapes=False)
            self._prof.__enter__()
        _active = True
        try:
            with record_function(f"step {step}"):
                yield
        finally:
            _active = False
        if step == self.steps[1] and self.finish():
            log.info("profile of steps %d:%d written to %s", *self.steps, self.path)

    def finish(self) -> Path | None:
        """Stop and write the trace (also when the run ends inside the range)."""
        if self._prof is None:
            return None
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path))
        return self.path
