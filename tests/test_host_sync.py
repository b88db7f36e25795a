"""No host sync inside a training step: reading tensors back (.item(), bool(), .tolist()) happens at log steps.

On a GPU a host sync stalls Python until the device has drained its queue, so the next kernels are not queued
ahead and the GPU idles between steps. CI has no GPU (there `torch.cuda.set_sync_debug_mode("error")` would
catch them), so these tests record the aten ops that force one on any device: `_local_scalar_dense` (what
.item(), bool(t), float(t) and int(t) call), `nonzero`, `masked_select`, indexing by a boolean mask,
`is_nonzero`, `equal`, `unique`; and `Tensor.tolist`/`Tensor.numpy`. Every layout's `train_step` must run none.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dist_llm.config import load_config
from dist_llm.parallel.context import ParallelContext
from dist_llm.train.trainer import Trainer
from tests.conftest import tiny_overrides
from tests.distributed import run_distributed
from tests.test_data_parallel import corpus  # noqa: F401 - a fixture

SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "allclose", "unique",
            "_unique", "_unique2", "unique_consecutive", "unique_dim"}


def _where() -> str:
    """The innermost dist_llm frame that asked for the sync."""
    frames = [f for f in traceback.extract_stack() if "/dist_llm/" in f.filename]
    return f"{frames[-1].filename.split('/dist_llm/')[-1]}:{frames[-1].lineno}" if frames else "?"


class HostSyncs(TorchDispatchMode):
    """Records every operation run inside it that makes the host wait for the tensor's device."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []
        self._patched: dict[str, Any] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func._overloadpacket.__name__
        mask_index = name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (args[1] or ()))
        if name in SYNC_OPS or mask_index:
            self.found.append(f"{name} at {_where()}")
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> "HostSyncs":
        for method in ("tolist", "numpy"):  # these read the data without an aten op
            original = getattr(torch.Tensor, method)
            self._patched[method] = original

            def record(t: torch.Tensor, *a: Any, _m: str = method, _f: Any = original, **k: Any) -> Any:
                self.found.append(f"Tensor.{_m} at {_where()}")
                return _f(t, *a, **k)

            setattr(torch.Tensor, method, record)
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for method, original in self._patched.items():
            setattr(torch.Tensor, method, original)
        self._patched.clear()


def test_the_detector_sees_each_kind_of_sync() -> None:
    t = torch.arange(6.0)
    cases = {"item": lambda: t.sum().item(), "bool": lambda: bool(t.sum() > 0), "mask": lambda: t[t > 2],
             "nonzero": lambda: t.nonzero(), "tolist": lambda: t.tolist(), "float": lambda: float(t[0])}
    for name, fn in cases.items():
        with HostSyncs() as syncs:
            fn()
        assert syncs.found, name
    with HostSyncs() as syncs:  # what a step may do: device-side decisions
        torch.where(torch.isfinite(t.sum()), t, 0.0).sum()
        torch._foreach_mul_([t], torch.tensor(0.5))
    assert syncs.found == []


def steps_with_syncs(rank: int, world_size: int, out_dir: Path, corpus: Path, extra: dict[str, Any]) -> list[list[str]]:
    """Train 4 steps (metrics logged at step 4 only) and return the syncs each `train_step` made."""
    overrides = {"data__source": str(corpus), "train__max_steps": 4, "train__log_interval": 4,
                 "train__eval_interval": 0, **extra}
    cfg = load_config(None, tiny_overrides(out_dir, **overrides))
    ctx = ParallelContext.from_config(cfg)
    try:
        trainer = Trainer(cfg, ctx)
        per_step: list[list[str]] = []
        step = trainer.train_step

        def watched() -> Any:
            with HostSyncs() as syncs:
                out = step()
            per_step.append(syncs.found)
            return out

        trainer.train_step = watched  # type: ignore[method-assign]
        trainer.fit()
        return per_step
    finally:
        ctx.destroy()


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_one_process_step_has_no_host_sync(tmp_path: Path, corpus: Path, precision: str) -> None:  # noqa: F811
    per_step = steps_with_syncs(0, 1, tmp_path, corpus, {"train__precision": precision, "train__micro_batch_size": 2})
    assert per_step == [[]] * 4


LAYOUTS = {
    "ddp": {"parallel__zero_stage": 0},
    "zero1-bf16": {"parallel__zero_stage": 1, "train__precision": "bf16"},
    "zero2-fp16": {"parallel__zero_stage": 2, "train__precision": "fp16"},
    "zero3": {"parallel__zero_stage": 3},
    "tp2-sp": {"parallel__tp": 2, "parallel__sequence_parallel": True},
    "pp2-1f1b": {"parallel__pp": 2, "train__micro_batch_size": 2},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_step_has_no_host_sync(tmp_path: Path, corpus: Path, layout: str) -> None:  # noqa: F811
    results = run_distributed(steps_with_syncs, 2, tmp_path, corpus, LAYOUTS[layout], init_group=False)
    for rank, per_step in enumerate(results):
        assert per_step == [[]] * 4, f"rank {rank}: {per_step}"
