"""Tensor (and sequence) parallelism against the unsharded computation, on gloo ranks."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_llm.config import load_config
from dist_llm.model import GPT
from dist_llm.parallel.context import ParallelContext
from dist_llm.parallel.tensor.checkpoint import TensorParallelState
from dist_llm.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from dist_llm.train.trainer import build_model
from tests.conftest import tiny_overrides
from tests.distributed import run_distributed
from tests.test_data_parallel import STEPS, assert_same_run, corpus, reference, train  # noqa: F401



def _seeded(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _normal_init(seed: int):  # type: ignore[no-untyped-def]
    return lambda t: t.copy_(_seeded(tuple(t.shape), seed))


def _layers(rank: int, world_size: int, sequence_parallel: bool) -> None:
    group = dist.group.WORLD
    B, T, C, H, V = 2, 8, 12, 16, 24
    x = _seeded((B, T, C), 1).requires_grad_()
    w1, w2 = _seeded((H, C), 2), _seeded((C, H), 3)
    # column then row parallel, as in the MLP, against the same two full linears
    col = ColumnParallelLinear(C, H, bias=True, group=group, sequence_parallel=sequence_parallel)
    row = RowParallelLinear(H, C, bias=True, group=group, sequence_parallel=sequence_parallel)
    col.init_from_full(_normal_init(2))
    row.init_from_full(_normal_init(3))
    with torch.no_grad():
        col.bias.copy_(_seeded((H,), 4)[col.rows])
        row.bias.copy_(_seeded((C,), 5))
    x_in = x.chunk(world_size, dim=1)[rank] if sequence_parallel else x
    y = row(F.gelu(col(x_in)))
    want = F.gelu(x @ w1.T + _seeded((H,), 4)) @ w2.T + _seeded((C,), 5)
    if sequence_parallel:
        want = want.chunk(world_size, dim=1)[rank]
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    g = _seeded(tuple(want.shape), 6)
    (y * g).sum().backward()
    xr = x.detach().clone().requires_grad_()
    w1r, w2r = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    full = F.gelu(xr @ w1r.T + _seeded((H,), 4)) @ w2r.T + _seeded((C,), 5)
    g_full = torch.zeros_like(full)
    if sequence_parallel:  # each rank's loss covers its slice: the reference sums all slices' weights
        parts = [_seeded(tuple(want.shape), 6) for _ in range(world_size)]
        g_full = torch.cat(parts, dim=1)
        (full * g_full).sum().backward()
    else:
        (full * g).sum().backward()
    if sequence_parallel:
        dist.all_reduce(x.grad)  # each rank holds the gradient of its loss slice w.r.t. the whole input
        row_bias = row.bias.grad.clone()
        dist.all_reduce(row_bias)  # a sequence-parallel parameter: partial sums over the sequence
    else:
        row_bias = row.bias.grad
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(col.weight.grad, w1r.grad[col.rows], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(row.weight.grad, w2r.grad[:, row.cols], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(row_bias, g_full.sum(dim=(0, 1)) if sequence_parallel else g.sum(dim=(0, 1)),
                               rtol=1e-5, atol=1e-5)

    # vocab-parallel embedding
    emb = VocabParallelEmbedding(V, C, group=group)
    emb.init_from_full(_normal_init(7))
    idx = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(8))
    out = emb(idx)
    torch.testing.assert_close(out, F.embedding(idx, _seeded((V, C), 7)))
    out.sum().backward()
    full_grad = torch.zeros(V, C).index_add_(0, idx.flatten(), torch.ones(B * T, C))
    torch.testing.assert_close(emb.weight.grad, full_grad[emb.vocab_start : emb.vocab_end])

    # vocab-parallel cross-entropy, with the last 5 ids as padding that must not count
    valid = V - 5
    logits = _seeded((B, T, V), 9)
    local = logits.chunk(world_size, dim=-1)[rank].clone().requires_grad_()
    targets = torch.randint(0, valid, (B, T), generator=torch.Generator().manual_seed(10))
    loss = vocab_parallel_cross_entropy(local, targets, vocab_start=rank * (V // world_size), valid=valid,
                                        group=group)
    ref_logits = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits[..., :valid].flatten(0, 1), targets.flatten())
    torch.testing.assert_close(loss, ref)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(local.grad, ref_logits.grad.chunk(world_size, dim=-1)[rank], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_layers_match_unsharded(tp: int, sequence_parallel: bool) -> None:
    run_distributed(_layers, tp, sequence_parallel)


MODEL_VARIANTS = {
    "gpt2": {},
    "sp": {"parallel__sequence_parallel": True},
    "gqa": {"model__n_head": 4, "model__n_kv_head": 2, "model__pos_emb": "rope"},  # at tp=4: KV replicated
    "mqa-sp": {"model__n_head": 4, "model__n_kv_head": 1, "parallel__sequence_parallel": True},
    "llama": {"model__pos_emb": "rope", "model__norm": "rmsnorm", "model__mlp": "swiglu", "model__bias": False,
              "model__tie_embeddings": False},
    "alibi-sp": {"model__pos_emb": "alibi", "parallel__sequence_parallel": True},
    "llama-sp": {"model__pos_emb": "rope", "model__norm": "rmsnorm", "model__mlp": "swiglu", "model__bias": True,
                 "parallel__sequence_parallel": True},  # (gate and up share one gather; biases sharded by rows)
}


def _whole_model(rank: int, world_size: int, out_dir: Path, extra: dict[str, Any]) -> None:
    cfg = load_config(None, tiny_overrides(out_dir, parallel__tp=world_size, **extra))
    ctx = ParallelContext.from_config(cfg)
    model = build_model(cfg, ctx)
    ref = GPT(cfg.model)
    ref.reset_parameters(cfg.train.seed)  # the initialisation every layout builds
    idx = torch.randint(0, cfg.model.vocab_size, (4, cfg.model.block_size), generator=torch.Generator().manual_seed(0))
    tgt = torch.randint(0, cfg.model.vocab_size, (4, cfg.model.block_size), generator=torch.Generator().manual_seed(1))
    model.train(), ref.train()
    torch.testing.assert_close(model.eval()(idx), ref.eval()(idx), rtol=1e-5, atol=1e-5)  # gathered logits
    model.train(), ref.train()
    loss, ref_loss = model(idx, tgt), ref(idx, tgt)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    loss.backward()
    ref_loss.backward()
    from dist_llm.parallel.tensor import sync_sequence_parallel_grads

    sync_sequence_parallel_grads([(p, p.grad, 0) for p in model.parameters()], ctx)
    state = TensorParallelState(model, ctx)
    grads = {"model": {n: p.grad for n, p in model.named_parameters()}, "optim": {"state": {}}}
    full = state.to_full(grads)["model"]
    for name, p in ref.named_parameters():
        torch.testing.assert_close(full[name], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    ctx.destroy()


@pytest.mark.parametrize("variant", list(MODEL_VARIANTS))
@pytest.mark.parametrize("tp", [2, 4])
def test_whole_model_logits_and_grads(tmp_path: Path, tp: int, variant: str) -> None:
    run_distributed(_whole_model, tp, tmp_path, MODEL_VARIANTS[variant], init_group=False)


@pytest.mark.parametrize("variant", ["gpt2", "sp", "gqa", "mqa-sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_training_matches_tp1(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path,  # noqa: F811
                              tp: int, variant: str) -> None:
    variant_keys = dict(MODEL_VARIANTS[variant])
    extra = {"parallel__tp": tp, **variant_keys}
    model_only = {k: v for k, v in variant_keys.items() if k.startswith("model__")}
    got = run_distributed(train, tp, tmp_path, corpus, extra, init_group=False)[0]
    assert_same_run(got, reference(tmp_path_factory, corpus, **model_only), rtol=1e-5)


@pytest.mark.parametrize("zero_stage", [0, 1, 3])
def test_dp2_tp2(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path,  # noqa: F811
                 zero_stage: int) -> None:
    extra = {"parallel__tp": 2, "parallel__zero_stage": zero_stage, "train__micro_batch_size": 4}
    got = run_distributed(train, 4, tmp_path, corpus, extra, init_group=False)[0]
    assert_same_run(got, reference(tmp_path_factory, corpus), rtol=1e-5)


def test_checkpoint_moves_between_tp(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                     corpus: Path) -> None:  # noqa: F811
    first = tmp_path / "first"
    run_distributed(train, 2, first, corpus, {"parallel__tp": 2, "train__stop_after_step": 4,
                                              "train__ckpt_interval": 4}, init_group=False)
    ref = reference(tmp_path_factory, corpus)
    for tp in (1, 4):
        out = tmp_path / f"tp{tp}"
        shutil.copytree(first, out)
        got = run_distributed(train, tp, out, corpus, {"parallel__tp": tp}, init_group=False)[0]
        for a, b in zip(got["losses"][4:], ref["losses"][4:], strict=True):
            assert a == pytest.approx(b, rel=1e-5)


SHARDED = ("qkv.weight", "qkv.bias", "attn.proj.weight", "mlp.up.weight", "mlp.up.bias", "mlp.gate.weight",
           "mlp.down.weight", "wte.weight")


def _param_bytes(rank: int, world_size: int, out_dir: Path) -> dict[str, int]:
    cfg = load_config(None, tiny_overrides(out_dir, parallel__tp=world_size))
    ctx = ParallelContext.from_config(cfg)
    model = build_model(cfg, ctx)
    ctx.destroy()
    return {n: p.numel() * p.element_size() for n, p in model.named_parameters()}


def test_block_parameters_are_split_by_tp(tmp_path: Path) -> None:
    full = _param_bytes(0, 1, tmp_path)
    for tp in (2, 4):
        got = run_distributed(_param_bytes, tp, tmp_path, init_group=False)[0]
        assert got.keys() == full.keys()
        for name, nbytes in full.items():
            sharded = name.endswith(SHARDED)
            assert got[name] == (nbytes // tp if sharded else nbytes), name
        blocks = sum(v for k, v in got.items() if k.startswith("blocks."))
        replicated = sum(v for k, v in full.items() if k.startswith("blocks.") and not k.endswith(SHARDED))
        assert blocks == (sum(v for k, v in full.items() if k.startswith("blocks.")) - replicated) // tp + replicated


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_tp_communication_matches_megatron(tmp_path: Path, corpus: Path, sequence_parallel: bool) -> None:  # noqa: F811
    """Per step, a transformer layer all-reduces b*s*h activations twice in forward and twice in backward;
    the embedding adds one (forward) and the LM head's input one (backward). With sequence parallelism each
    all-reduce becomes an all-gather plus a reduce-scatter: the same bytes; and as in Megatron-Core each column
    layer (qkv, up, the head: 2L + 1) all-gathers its input again in backward, having kept only its slice."""
    tp = 2
    got = run_distributed(train, tp, tmp_path, corpus, {"parallel__tp": tp,
                                                         "parallel__sequence_parallel": sequence_parallel},
                          init_group=False)[0]
    cfg = load_config(None, tiny_overrides(tmp_path))
    tokens = cfg.train.global_batch_size * cfg.model.block_size  # b*s over the step's micro-batches
    activations = (4 * cfg.model.n_layer + 2) * tokens * cfg.model.n_embd * 4  # bytes of all those tensors
    want = 2 * (tp - 1) / tp * activations
    regather = (tp - 1) / tp * (2 * cfg.model.n_layer + 1) * tokens * cfg.model.n_embd * 4
    if sequence_parallel:
        want += regather
    sent = sum(got["comm"].values())
    assert abs(sent - want) <= 0.10 * want, (got["comm"], want)
    if sequence_parallel:
        assert got["comm"]["reduce_scatter"] == (tp - 1) / tp * activations
        # (and the learned positions' gradient, (T, C) per micro-batch, gathered from the sequence slices)
        micro = cfg.train.global_batch_size // cfg.train.micro_batch_size
        positions = micro * (tp - 1) / tp * cfg.model.block_size * cfg.model.n_embd * 4
        assert got["comm"]["all_gather"] == (tp - 1) / tp * activations + regather + positions
    else:
        assert set(got["comm"]) == {"all_reduce"}


@pytest.mark.parametrize("extra", [{"train__activation_checkpointing": "full"},
                                   {"train__activation_checkpointing": "selective", "parallel__sequence_parallel": True}],
                         ids=["full", "selective-sp"])
def test_with_activation_checkpointing(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path,  # noqa: F811
                                       extra: dict[str, Any]) -> None:
    got = run_distributed(train, 2, tmp_path, corpus, {"parallel__tp": 2, **extra}, init_group=False)[0]
    assert_same_run(got, reference(tmp_path_factory, corpus), rtol=1e-5)


def test_bf16(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> None:  # noqa: F811
    got = run_distributed(train, 2, tmp_path, corpus, {"parallel__tp": 2, "train__precision": "bf16"},
                          init_group=False)[0]
    ref = reference(tmp_path_factory, corpus, train__precision="bf16")
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert a == pytest.approx(b, abs=1e-2)


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_dp2_tp2_replicated_kv(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path,  # noqa: F811
                               zero_stage: int) -> None:
    """One KV head over tp=2: both ranks hold it and sum its gradient; the global norm counts it once, also
    when ZeRO-2 (small buckets) or FSDP2 splits that gradient over dp."""
    kv = {"model__n_kv_head": 1}
    extra = {"parallel__tp": 2, "parallel__zero_stage": zero_stage, "train__micro_batch_size": 4,
             "parallel__bucket_mb": 0.01, **kv}
    got = run_distributed(train, 4, tmp_path, corpus, extra, init_group=False)[0]
    assert_same_run(got, reference(tmp_path_factory, corpus, **kv), rtol=1e-5)


def test_dropout_replays_under_recomputation(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    """With dropout, attention masks come from a tp-local stream seeded from the shared one, so recomputing
    blocks in backward (activation checkpointing) replays them: the run is the same with and without it."""
    runs = [run_distributed(train, 2, tmp_path / mode, corpus,
                            {"parallel__tp": 2, "model__dropout": 0.1, "train__activation_checkpointing": mode},
                            init_group=False)[0] for mode in ("none", "full")]
    assert runs[0]["losses"] == runs[1]["losses"]
    no_dropout = run_distributed(train, 2, tmp_path / "off", corpus, {"parallel__tp": 2}, init_group=False)[0]
    assert no_dropout["losses"][0] != runs[0]["losses"][0]  # dropout really was on
