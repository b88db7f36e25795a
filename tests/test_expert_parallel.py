"""Expert parallelism (parallel.ep): experts split over ep of the dp ranks, tokens moved by all-to-all.

Every layout is compared with one process in fp32 at 1e-5: the same tokens meet the same experts with the same
weights, only the place where each row is computed and the order of the gradient sums change (the expert
gradients sum over the ep ranks in the all-to-all's backward, then over the expert-dp group), so the results
differ by float rounding of reordered sums alone. The reference runs at the same micro-batch size, since the
balancing losses are per forward."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_llm.config import ConfigError, load_config
from dist_llm.parallel.context import ParallelContext
from tests.conftest import tiny_overrides
from tests.distributed import run_distributed
from tests.test_data_parallel import STEPS, assert_same_run, corpus, reference, train  # noqa: F401 - corpus: fixture

MOE = {"model__n_experts": 4, "model__moe_top_k": 2, "model__moe_z_loss_coef": 0.001}
VARIANTS = {"plain": {}, "shared+bias": {"model__n_shared_experts": 1, "model__moe_bias_update_rate": 0.01}}


@pytest.mark.parametrize("world,ep,zero_stage,variant", [
    (2, 2, 0, "shared+bias"), (2, 2, 1, "plain"), (2, 2, 2, "shared+bias"),
    (4, 2, 0, "plain"), (4, 2, 1, "shared+bias"), (4, 2, 2, "plain"),
    (4, 4, 0, "shared+bias"), (4, 4, 1, "plain"), (4, 4, 2, "shared+bias"),
])
def test_matches_single_process(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path,
                                world: int, ep: int, zero_stage: int, variant: str) -> None:
    extra = {**MOE, **VARIANTS[variant], "train__micro_batch_size": 8 // world}
    results = run_distributed(train, world, tmp_path, corpus, {**extra, "parallel__ep": ep,
                                                               "parallel__zero_stage": zero_stage,
                                                               "parallel__bucket_mb": 0.01}, init_group=False)
    ref = reference(tmp_path_factory, corpus, **extra)
    assert_same_run(results[0], ref, rtol=1e-5)
    for r in results[1:]:  # every rank ends with the same whole model (its experts gathered over the ep group)
        for name, p in results[0]["params"].items():
            torch.testing.assert_close(r["params"][name], p, rtol=0, atol=0)
    for a, b in zip(results[0]["records"], ref["records"], strict=True):
        assert a["moe_imbalance"] == pytest.approx(b["moe_imbalance"], rel=1e-5)
        assert a["moe_aux_loss"] == pytest.approx(b["moe_aux_loss"], rel=1e-5)
