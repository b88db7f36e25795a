"""The backward split of zero-bubble schedules (split_backward.py): B then W equal one backward, process-free."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dist_llm.config import load_config
from dist_llm.model import GPT
from dist_llm.parallel.pipeline import split_backward
from dist_llm.parallel.pipeline.split_backward import backward_input, backward_weights
from dist_llm.train.saved_tensors import SavedTensorMeter


def _blocks(checkpointing: str = "none", *extra: str) -> GPT:
    torch.manual_seed(0)
    cfg = load_config(None, ["model.n_layer=2", "model.n_embd=32", "model.n_head=4", "model.block_size=16", *extra])
    model = GPT(cfg.model)
    model.set_activation_checkpointing(checkpointing)  # type: ignore[arg-type]
    return model


def _run(model: GPT, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    inp = x.clone().requires_grad_()
    h = inp
    for block in model.blocks:
        h = block(h)  # (B, T, C)
    return inp, h


def test_w_recomputes_a_checkpointed_block_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under full activation checkpointing B recomputes each block once, and so does W (a backward per branch point
    recomputed a block once per weight op in it: 6 times here); the gradients are the one backward's
    (test_b_then_w_equals_one_backward)."""
    model = _blocks("full")
    runs: list[int] = []
    for i, block in enumerate(model.blocks):
        inner = block._forward
        monkeypatch.setattr(block, "_forward", lambda x, inner=inner, i=i: (runs.append(i), inner(x))[1])
    inp, out = _run(model, torch.randn(2, 16, 32))
    assert runs == [0, 1]  # the forward
    runs.clear()
    d_inp, work = backward_input(out, torch.randn(2, 16, 32), inp, list(model.blocks.parameters()))
    del out
    assert sorted(runs) == [0, 1]  # B's recomputation
    runs.clear()
    backward_weights(work)
    assert sorted(runs) == [0, 1]
    assert all(p.grad is not None for p in model.blocks.parameters())


class _LiveTensors(TorchDispatchMode):
    """Counts the tensors the ops under it make that are still alive (weakref.finalize: a tensor a saved-tensor
    slot holds stays alive with its Python object)."""

    def __init__(self, live: list[int]) -> None:
        super().__init__()
        self.live = live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.live[0] += 1
                weakref.finalize(t, lambda live=self.live: live.__setitem__(0, live[0] - 1))
        return out


def test_w_frees_a_blocks_recomputed_tensors_before_it_recomputes_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    """W under full checkpointing holds one block's recomputed tensors at a time, not every block's to its end (it
    took the branches input side first and kept them all: 3 blocks alive at once here, each one's left after W)."""
    model = _blocks("full")
    model.blocks.append(_blocks("full").blocks[0])
    live: dict[int, list[int]] = {i: [0] for i in range(3)}
    most = [0]
    in_w = [False]
    for i, block in enumerate(model.blocks):
        inner = block._forward

        def forward(x: torch.Tensor, inner=inner, i=i) -> torch.Tensor:  # type: ignore[no-untyped-def]
            if not in_w[0]:
                return inner(x)
            most[0] = max(most[0], 1 + sum(1 for j, n in live.items() if j != i and n[0] > 0))
            with _LiveTensors(live[i]):
                return inner(x)

        monkeypatch.setattr(block, "_forward", forward)
    inp, out = _run(model, torch.randn(2, 16, 32))
    _, work = backward_input(out, torch.randn(2, 16, 32), inp, list(model.blocks.parameters()))
    del out
    in_w[0] = True
    backward_weights(work)
    assert most[0] == 1
    assert [n[0] for n in live.values()] == [0, 0, 0]


MOE = ("model.n_experts=4", "model.moe_top_k=2", "model.n_shared_experts=1")


@pytest.mark.parametrize("checkpointing,extra,group",
                         [("none", (), True), ("full", (), True), ("selective", (), True), ("full", MOE, True),
                          ("full", (), False)],
                         ids=["none", "full", "selective", "moe-full", "full-without-group"])
def test_b_then_w_equals_one_backward(checkpointing: str, extra: tuple[str, ...], group: bool,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A middle stage's two blocks: B's input gradient and W's weight gradients are the one backward's, bit for
    bit (the same terms; each parameter's gradient is one accumulation here), W's accumulate into .grad through
    AccumulateGrad (the post-accumulate hooks ZeRO-1/2 count on fire once per parameter), and B leaves no .grad.
    MoE blocks under full checkpointing: W's branches in one recompute group read no saved tensor twice. Without
    the group (torch before 2.10: a backward per branch) the same gradients."""
    if not group:
        monkeypatch.setattr(split_backward, "_GraphExecGroup", None)
    model = _blocks(checkpointing, *extra)
    x, g = torch.randn(2, 16, 32), torch.randn(2, 16, 32)
    inp, out = _run(model, x)
    out.backward(g)
    ref = {n: p.grad.clone() for n, p in model.blocks.named_parameters()}
    ref_inp = inp.grad
    model.zero_grad(set_to_none=True)
    fired: list[int] = []
    for p in model.blocks.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(id(p)))
    inp, out = _run(model, x)
    d_inp, work = backward_input(out, g, inp, list(model.blocks.parameters()))
    del out
    assert all(p.grad is None for p in model.blocks.parameters()) and fired == []
    assert work.root is None
    if not extra:
        assert len(work.branches) == 12  # per block: 2 norms, 4 linears (qkv, proj, fc, fc2)
    torch.testing.assert_close(d_inp, ref_inp, rtol=0, atol=0)
    backward_weights(work)
    assert sorted(fired) == sorted(id(p) for p in model.blocks.parameters())
    for n, p in model.blocks.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=0, atol=0, msg=n)


def test_w_skips_the_input_path() -> None:
    """W runs only the branches: counting the graph nodes autograd executes, B runs the input path (attention's
    core among them) and W none of it, only the weight matmuls and norms' weight halves."""
    model = _blocks()
    x, g = torch.randn(2, 16, 32), torch.randn(2, 16, 32)
    inp, out = _run(model, x)
    d_inp, work = backward_input(out, g, inp, list(model.blocks.parameters()))
    sdpa = [n for n, _, _ in work.branches if "Attention" in n.name()]
    assert sdpa == []  # attention's core has no weights: never a branch point
    ran: list[str] = []
    handles = []
    seen: set = set()
    stack = [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        handles.append(node.register_prehook(lambda grads, node=node: ran.append(node.name())))
        stack += [c for c, _ in node.next_functions]
    backward_weights(work)
    for h in handles:
        h.remove()
    assert not any("Attention" in name or "Gelu" in name for name in ran), ran


def test_a_weight_used_twice_falls_back_to_one_backward() -> None:
    """One norm applied before two layers: its weight is reached from a branch and from further down the input path,
    so the graph is not split (W runs the whole backward) and the gradients are still the one backward's."""
    torch.manual_seed(0)
    norm, a, b = nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 8)

    def f(x: torch.Tensor) -> torch.Tensor:
        h = x + a(norm(x))
        return h + b(norm(h))

    x, g = torch.randn(3, 8), torch.randn(3, 8)
    params = [*norm.parameters(), *a.parameters(), *b.parameters()]
    inp = x.clone().requires_grad_()
    f(inp).backward(g)
    ref = [p.grad.clone() for p in params]
    ref_inp = inp.grad
    for p in params:
        p.grad = None
    inp = x.clone().requires_grad_()
    d_inp, work = backward_input(f(inp), g, inp, params)
    assert work.root is not None and all(p.grad is None for p in params)
    backward_weights(work)
    torch.testing.assert_close(d_inp, ref_inp, rtol=0, atol=0)
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.grad, r, rtol=0, atol=0)


def test_first_stage_defers_its_whole_backward() -> None:
    """The first stage's input is token ids: no input gradient to send, so B does nothing and W the backward."""
    model = _blocks()
    ids = torch.randint(0, 64, (2, 16))
    loss = model(ids, ids)
    d_inp, work = backward_input(loss, None, None, list(model.parameters()))
    assert d_inp is None and work.root is loss and all(p.grad is None for p in model.parameters())
    backward_weights(work)
    assert all(p.grad is not None for p in model.parameters())


def test_the_saved_tensor_meter_lets_w_free_the_graph() -> None:
    """Under the activation meter (the trainer's first step, bench_pp) B keeps the graph whole for W, and once W has
    run, or a graph is dropped without a backward, nothing stays held. Before, the meter's pack hook kept each
    saved output (attention's, the norms' statistics) with its grad_fn: a cycle through C++ that only a backward
    without retain_graph breaks, so every split micro-batch of the metered step stayed alive for good (zb1's
    last stage held all m micro-batches' activations, not p)."""
    model = _blocks()
    params = list(model.blocks.parameters())
    x, g = torch.randn(2, 16, 32), torch.randn(2, 16, 32)
    with SavedTensorMeter(params) as meter:
        inp, out = _run(model, x)
        held = meter.live_bytes
        assert held > 0
        d_inp, work = backward_input(out, g, inp, params)
        del out
        assert meter.live_bytes == held  # retain_graph: W's branches keep the whole graph below them
        backward_weights(work)
        del work, inp
        assert meter.live_bytes == 0
        inp, out = _run(model, x)  # an evaluation-like graph, never backwarded
        del inp, out
        assert meter.live_bytes == 0
        assert meter.peak_bytes == held
