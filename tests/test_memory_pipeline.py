"""What ZB-H1's held-back W's keep (memory/pipeline.py), against the state the split backward really leaves."""

from __future__ import annotations

import contextlib

import pytest
import torch

from dist_llm.config import load_config
from dist_llm.memory import predict
from dist_llm.memory.pipeline import pending_weight_bytes
from dist_llm.model import GPT
from dist_llm.parallel.pipeline.executor import StageModel
from dist_llm.parallel.pipeline.split_backward import backward_input

LLAMA = ["model.norm=rmsnorm", "model.mlp=swiglu", "model.pos_emb=rope", "model.bias=false", "model.n_kv_head=2"]
GPT2 = ["model.norm=layernorm", "model.mlp=gelu", "model.pos_emb=learned", "model.bias=true"]


def _held_bytes(work) -> int:  # type: ignore[no-untyped-def]
    """Bytes of the gradients a WeightWork keeps, each storage once."""
    storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
                for _, grads, _ in work.branches for g in grads if g is not None}
    return sum(storages.values())


@pytest.mark.parametrize("last", [True, False])
@pytest.mark.parametrize(("shape", "precision"), [(LLAMA, "fp32"), (GPT2, "fp32"), (LLAMA, "bf16")])
def test_pending_w_bytes_equal_the_split_backwards(shape: list[str], precision: str, last: bool) -> None:
    """One micro-batch's W state on a stage of 2 blocks (and the head and loss when last), to the byte: every
    weight op's output gradient, matmuls' in the compute dtype, norms' in fp32 (the residual stream's dtype)."""
    torch.manual_seed(0)
    pp = 2 if last else 3  # stage 1: the last of 2, or the middle of 3; one micro-batch (m=1) in flight
    cfg = load_config(None, ["model.n_layer=3", "model.n_embd=32", "model.n_head=4", "model.block_size=16",
                             "train.micro_batch_size=2", "train.global_batch_size=2",
                             f"train.precision={precision}", f"parallel.pp={pp}", "parallel.pp_schedule=zb1", *shape])
    model = GPT(cfg.model)
    stage = StageModel(model, range(1, 3), first=False, last=last)
    inp = torch.randn(2, 16, 32, requires_grad=True)
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext())
    with autocast:
        out = stage.forward(inp)
        if last:
            out = model.loss(out, torch.randint(0, 256, (2, 16)), reduction="sum")
    grad = None if last else torch.randn_like(out)
    _, work = backward_input(out, grad, inp, list(model.parameters()))
    assert work.root is None and work.branches
    expected = pending_weight_bytes(cfg, tp=1, pp=pp, pp_rank=1, dp=1, blocks=2, params16=False)
    assert _held_bytes(work) == expected


def test_memory_adds_the_pending_w_state_on_split_stages() -> None:
    """`dist-llm memory` at pp=2, m=8: ZB-H1's last stage holds 2 micro-batches' W state (stage + 1), its first
    none (not split), 1F1B none; the peak includes it."""
    common = ["model.n_layer=4", "parallel.pp=2", "train.micro_batch_size=2", "train.global_batch_size=16"]
    one = pending_weight_bytes(load_config(None, [*common, "parallel.pp_schedule=zb1", "train.global_batch_size=2"]),
                               tp=1, pp=2, pp_rank=1, dp=1, blocks=2, params16=False)
    cfg = load_config(None, [*common, "parallel.pp_schedule=zb1"])
    assert one and pending_weight_bytes(cfg, tp=1, pp=2, pp_rank=1, dp=1, blocks=2, params16=False) == 2 * one
    zb = [predict(cfg, pp_rank=s) for s in (0, 1)]
    assert zb[0].pending_weight_bytes == 0 and zb[1].pending_weight_bytes == 2 * one
    assert zb[1].peak_bytes == (zb[1].model_states_bytes + zb[1].activation_bytes + zb[1].temporary_bytes
                                + 2 * one)
    assert predict(load_config(None, [*common, "parallel.pp_schedule=1f1b"]), pp_rank=1).pending_weight_bytes == 0
