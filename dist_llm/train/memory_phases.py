"""Peak memory per phase of a run, on every rank: start-up, resume, the first step, later steps, saving.

Linux keeps a process's peak resident set (VmHWM) and lets the process reset it (writing 5 to
/proc/self/clear_refs); CUDA's allocator keeps `max_memory_allocated` and resets it with
`reset_peak_memory_stats`. So at each phase boundary the trainer reads both peaks and resets them: the
figures cost two file operations per boundary, a few per run. Where the host's peak cannot be reset the
figures are the running peak since the process began, and the event says so (`host_peak`).

The event, written once by rank 0 when training ends (every rank's figures gathered):
    {"event": "memory_phases", "step": 3, "host_peak": "per phase" | "running (clear_refs not writable)",
     "rss_at_start_bytes": [...by rank], "pp_rank": [...by rank], "phases": ["startup", "step1", ...],
     "rank_peaks": {"host": {"startup": [...by rank], ...}, "cuda": {...}}}   (cuda only on a GPU)
`rss_at_start_bytes` is the resident set when the trainer began (torch, dist_llm and the process group
loaded): an idle rank, the baseline the peaks are compared with (scripts/bench_scale.py).
"""

from __future__ import annotations

from typing import Any

import torch

from dist_llm import perf
from dist_llm.parallel import comm
from dist_llm.parallel.context import ParallelContext

#: the phases, in the order a run passes them: process start until the model, optimizer and data are ready
#: (and the rest of fit's preparation); loading a checkpoint; the first step of this process; the steps after
#: it (with evaluation); saving a checkpoint (its synchronous part and the wait for a background write)
PHASES = ("startup", "resume", "step1", "train", "save")
_CPU = torch.device("cpu")


class PhaseMeter:
    """The peaks of this rank's phases; `end(phase)` closes the phase running since the last boundary."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.rss_at_start = perf.memory_bytes(_CPU)
        self.per_phase = True  # False once the host's peak could not be reset
        self.peaks: dict[str, tuple[int, int]] = {}  # phase -> (host, cuda); the max over its occurrences
        self._since_training = (0, 0)  # the peaks of the phases since `training_began`

    def _read(self) -> tuple[int, int]:
        return perf.peak_memory_bytes(_CPU), perf.peak_memory_bytes(self.device) if self.cuda else 0

    def end(self, phase: str, *, keep: bool = True) -> None:
        """Record the peaks since the last boundary as `phase` (unless not `keep`), and start new ones."""
        assert phase in PHASES, phase
        host, cuda = self._read()
        if keep:
            old = self.peaks.get(phase, (0, 0))
            self.peaks[phase] = (max(old[0], host), max(old[1], cuda))
        self._since_training = (max(self._since_training[0], host), max(self._since_training[1], cuda))
        self.per_phase = perf.reset_peak_memory(_CPU) and self.per_phase
        if self.cuda:
            perf.reset_peak_memory(self.device)

    def training_began(self) -> None:
        """From here `training_peak` covers training only (it spans the phases that end after this)."""
        self._since_training = (0, 0)

    def training_peak(self) -> int:
        """The device's peak since `training_began` (see perf.peak_memory_bytes), across phase boundaries."""
        host, cuda = self._read()
        return max(self._since_training[1], cuda) if self.cuda else max(self._since_training[0], host)

    def event(self, ctx: ParallelContext, step: int) -> dict[str, Any]:
        """Every rank's phase peaks, gathered (a collective: every rank calls it); the metrics event."""
        mine = [self.rss_at_start, ctx.pp_rank, int(self.per_phase)]
        for phase in PHASES:
            mine += list(self.peaks.get(phase, (-1, -1)))
        local = torch.tensor(mine, dtype=torch.int64)
        if ctx.world_size > 1:
            every = torch.zeros(ctx.world_size * len(mine), dtype=torch.int64)
            comm.all_gather(every, local, ctx.cpu_group, None)
            rows = every.view(ctx.world_size, len(mine)).tolist()
        else:
            rows = [local.tolist()]
        phases = [p for i, p in enumerate(PHASES) if rows[0][3 + 2 * i] >= 0]  # the ranks pass the same phases
        peaks: dict[str, Any] = {"host": {p: [r[3 + 2 * PHASES.index(p)] for r in rows] for p in phases}}
        if self.cuda:
            peaks["cuda"] = {p: [r[4 + 2 * PHASES.index(p)] for r in rows] for p in phases}
        per_phase = all(r[2] for r in rows)
        return {"event": "memory_phases", "step": step,
                "host_peak": "per phase" if per_phase else "running (clear_refs not writable)",
                "rss_at_start_bytes": [r[0] for r in rows], "pp_rank": [r[1] for r in rows], "phases": phases,
                "rank_peaks": peaks}
