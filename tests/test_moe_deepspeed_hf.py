"""MoE under `parallel.backend=deepspeed` ZeRO-3 started from a Hugging Face Mixtral and Qwen2-MoE
(`model.init_from=hf:`): each parameter read whole on one rank and handed to DeepSpeed's partitioner, so that every
rank keeps its partitions alone (no rank holds the whole model), with the file's values, and a few steps train to
the losses of one native process started from the same directory.

Both files in one spawned world (two trainers in turn, the harness's process group kept between them): DeepSpeed's
start-up is most of the test. Losses at 1e-5 relative in fp32: the same weights (read from the same file), the same
tokens in the same micro-batches of 2 (the balancing losses are per forward), the same routing; only the order of
the gradient sums differs (DeepSpeed's reduce-scatter of two ranks' sums against one process's accumulation of four
micro-batches), rounding at ~1e-7 that four Adam steps carry into the losses well below 1e-5 (measured: 9e-8). A
wrong read (an expert swapped or transposed, a shared gate missed) moves the first loss by far more; the weights
are compared bit for bit besides."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_data_parallel import corpus, train  # noqa: F401 - corpus: fixture

STEPS = 4  # (the routing, shared gate and aux-free bias all act from the first step: a few show them)
# z-loss and the aux-free bias on top of the aux loss (its default); micro-batches of 2 in both runs
RUN = {"model__moe_z_loss_coef": 0.001, "model__moe_bias_update_rate": 0.01, "train__micro_batch_size": 2,
       "train__max_steps": STEPS}
ZERO3 = {"parallel__backend": "deepspeed", "parallel__zero_stage": 3}
KINDS = ("mixtral", "qwen2_moe")


def _zero3_from_hf(rank: int, world_size: int, out_dir: Path, corpus: Path,  # noqa: F811
                   starts: dict[str, Path]) -> dict[str, Any]:
    """For each Hugging Face directory in `starts`, a DeepSpeed ZeRO-3 trainer started from it: what this rank read
    of the files while building, every parameter as built (gathered for the comparison, after the build), the
    expert biases, how many elements of each parameter this rank keeps, and (rank 0) the losses of STEPS steps."""
    import deepspeed

    from dist_llm.config import load_config
    from dist_llm.parallel.context import ParallelContext
    from dist_llm.train.trainer import Trainer
    from tests.conftest import tiny_overrides
    from tests.test_deepspeed_init_from import _count_reads

    out: dict[str, Any] = {}
    for kind, hf in starts.items():
        where = out_dir / kind
        cfg = load_config(None, tiny_overrides(where, **{"data__source": str(corpus), "train__eval_interval": 0,
                                                         "model__bias": False, **RUN, **ZERO3,
                                                         "model__init_from": f"hf:{hf}"}))
        with pytest.MonkeyPatch.context() as patch:
            reads = _count_reads(patch)
            trainer = Trainer(cfg, ParallelContext.from_config(cfg))
        params = dict(trainer.module.named_parameters())
        kept = {n: (p.ds_tensor.numel(), p.ds_numel) for n, p in params.items()}
        with deepspeed.zero.GatheredParameters(list(params.values())):
            built = {n: p.detach().clone() for n, p in params.items()}
        bias = {n: b.clone() for n, b in trainer.module.named_buffers() if n.endswith("expert_bias")}
        trainer.fit()
        lines = (where / "metrics.jsonl").read_text().splitlines() if rank == 0 else []
        out[kind] = {"built": built, "bias": bias, "kept": kept, "dp": trainer.dp.name, "hf_bytes": reads["hf_bytes"],
                     "losses": [r["loss"] for r in map(json.loads, lines) if "loss" in r]}
        del trainer
    return out


def test_zero3_from_hf_mixtral_and_qwen2_moe_is_the_file_and_trains_as_one_process(tmp_path: Path,
                                                                                   corpus: Path) -> None:  # noqa: F811
    """dp=2 DeepSpeed ZeRO-3 from `model.init_from=hf:` of a tiny random Mixtral and a Qwen2-MoE (shared expert
    with its sigmoid gate, q/k/v biases): every parameter bit for bit the file's (as `load_hf` reads it in one
    process), the expert bias at its start (zero: neither format has one), each rank keeping about half of every
    parameter, the first of them having read each tensor of the file once and the other none; 4 steps with z-loss and
    the aux-free bias give the one-process losses."""
    pytest.importorskip("transformers")
    from dist_llm.hf import load_hf, read_hf_tensors
    from tests.test_hf_moe import hf_moe

    starts = {}
    for seed, kind in enumerate(KINDS):
        torch.manual_seed(10 + seed)
        starts[kind] = tmp_path / f"hf-{kind}"
        hf_moe(kind).save_pretrained(starts[kind])
    ranks = run_distributed(_zero3_from_hf, 2, tmp_path / "ds", corpus, starts, timeout=600)
    for kind, hf in starts.items():
        want = dict(load_hf(hf).named_parameters())
        # only the partitioner's source rank reads, every tensor of the file once (DeepSpeed broadcasts it)
        assert [r[kind]["hf_bytes"] for r in ranks] == [sum(t.nbytes for t in read_hf_tensors(hf).values()), 0]
        for rank in ranks:
            got = rank[kind]
            assert got["dp"] == "deepspeed"
            assert got["built"].keys() == want.keys(), kind
            for name, p in want.items():
                assert torch.equal(got["built"][name], p.detach()), f"{kind}: {name}"
            assert got["bias"] and all(torch.count_nonzero(b) == 0 for b in got["bias"].values()), kind
            for name, (held, whole) in got["kept"].items():  # (DeepSpeed pads a partition to a whole share)
                assert held == -(-whole // 2), f"{kind}: {name} {held} of {whole}"
        native = train(0, 1, tmp_path / f"native-{kind}", corpus, {**RUN, "model__init_from": f"hf:{hf}"})
        losses = ranks[0][kind]["losses"]
        assert len(losses) == len(native["losses"]) == STEPS, kind
        for step, (a, b) in enumerate(zip(losses, native["losses"], strict=True), 1):
            assert a == pytest.approx(b, rel=1e-5), (kind, step)
