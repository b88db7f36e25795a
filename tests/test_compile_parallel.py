"""train.compile with the layouts whose collectives sit inside a transformer block: tp=2 with sequence parallelism,
cp=2 (the ring) and ep=2 (the all-to-all dispatch). Each collective is kept out of the compiled graphs
(dist_llm/compiling.py's keep_out_of_graphs, torch's lazily loaded disable, on the tp mappings, ring_attention and
the expert dispatch), so Dynamo breaks the graph around it. Before, tp2+SP failed inside Dynamo (a fake-tensor
call in comm.all_gather's gloo path) and cp and ep were refused.

Each layout trains 4 compiled steps at world 2 and is compared with one eager process in fp32 at rel 1e-6: the
collectives and the matmuls run as in an eager run (the same kernels, the same reduction order over the ranks),
and compiling changes only the rounding of the elementwise kernels Inductor fuses (norms, activations, residual
adds: a few ulps), which 4 Adam steps carry into the losses at ~1e-7 (measured 9e-8 for each layout). All
three layouts share one spawned world (one process pays Inductor's cold start); Dynamo is reset between them so
that no layout meets another's recompile limit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.distributed import run_distributed
from tests.test_data_parallel import corpus, reference, train  # noqa: F401 - corpus: fixture

STEPS = 4
BASE = {"train__max_steps": STEPS}
MOE = {"model__n_experts": 4, "model__moe_top_k": 2, "train__micro_batch_size": 4}
LAYOUTS = {"tp2+sp": {"parallel__tp": 2, "parallel__sequence_parallel": True},
           "cp2": {"parallel__cp": 2},
           "ep2": {**MOE, "parallel__ep": 2}}


def _compiled_runs(rank: int, world_size: int, out_dir: Path, corpus: Path) -> dict[str, Any]:  # noqa: F811
    import torch._dynamo
    from torch._dynamo.utils import counters

    runs = {}
    for name, extra in LAYOUTS.items():
        torch._dynamo.reset()
        counters.clear()
        result = train(rank, world_size, out_dir / name, corpus, {**BASE, **extra, "train__compile": True})
        result["graphs"] = counters["stats"]["unique_graphs"]
        runs[name] = result
    return runs


def test_compiled_layouts_equal_eager(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                      corpus: Path) -> None:  # noqa: F811
    runs = run_distributed(_compiled_runs, 2, tmp_path, corpus)  # one process group for the three
    for name, extra in LAYOUTS.items():
        moe = {k: v for k, v in extra.items() if not k.startswith("parallel__")}
        ref = reference(tmp_path_factory, corpus, **BASE, **moe)  # one eager process (the dense one shared)
        for rank in runs:
            assert rank[name]["graphs"] > 0, f"{name}: nothing was compiled"
        got = runs[0][name]["losses"]
        assert len(got) == STEPS
        for a, b in zip(got, ref["losses"], strict=True):
            assert a == pytest.approx(b, rel=1e-6), name
