"""The GPT against plain reference implementations: attention (MHA/GQA/MQA), RoPE, ALiBi, checkpointing."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

from dist_llm.config import ModelConfig
from dist_llm.model import GPT
from dist_llm.model.positions import alibi_slopes


def small(**kw: object) -> ModelConfig:
    base = dict(n_layer=2, n_head=4, n_embd=32, vocab_size=64, block_size=16)
    base.update(kw)
    return ModelConfig(**base)  # type: ignore[arg-type]


def reference_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE as a complex rotation of the pairs (x_i, x_{i+d/2}) by angle pos * theta^(-2i/d)."""
    B, H, T, D = x.shape
    half = D // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / D)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * freqs[None, :]  # (T, D/2)
    z = torch.complex(x[..., :half].double(), x[..., half:].double()) * torch.polar(torch.ones_like(angles), angles)
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


def reference_attention(model: GPT, layer: int, x: torch.Tensor) -> torch.Tensor:
    """Attention of block `layer` written out: softmax(q k^T / sqrt(d) + bias) v with kv heads repeated."""
    cfg = model.cfg
    attn = model.blocks[layer].attn
    B, T, _ = x.shape
    hd, nh, nkv = cfg.head_dim, cfg.n_head, cfg.kv_heads
    qkv = x @ attn.qkv.weight.T + (attn.qkv.bias if attn.qkv.bias is not None else 0)
    q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    q = q.view(B, T, nh, hd).transpose(1, 2)
    k = k.view(B, T, nkv, hd).transpose(1, 2)
    v = v.view(B, T, nkv, hd).transpose(1, 2)
    if cfg.pos_emb == "rope":
        q, k = reference_rope(q, cfg.rope_theta), reference_rope(k, cfg.rope_theta)
    k = k.repeat_interleave(nh // nkv, dim=1)  # query head h uses kv head h // (nh / nkv)
    v = v.repeat_interleave(nh // nkv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)  # (B, nh, T, T)
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    if cfg.pos_emb == "alibi":
        scores = scores - alibi_slopes(nh)[:, None, None] * (i - j).clamp(min=0)
    scores = scores.masked_fill(j > i, float("-inf"))
    y = F.softmax(scores, dim=-1) @ v
    y = y.transpose(1, 2).reshape(B, T, nh * hd)
    return y @ attn.proj.weight.T + (attn.proj.bias if attn.proj.bias is not None else 0)


@pytest.mark.parametrize(
    "kw",
    [
        dict(pos_emb="learned"),
        dict(pos_emb="rope"),
        dict(pos_emb="alibi"),
        dict(pos_emb="alibi", n_head=6, n_embd=48),  # ALiBi slopes for a head count that is not a power of 2
        dict(pos_emb="rope", n_kv_head=2),  # GQA
        dict(pos_emb="rope", n_kv_head=1, bias=False),  # MQA
        dict(pos_emb="alibi", n_kv_head=2),
    ],
    ids=["learned", "rope", "alibi", "alibi6", "gqa", "mqa", "alibi-gqa"],
)
def test_attention_matches_reference(kw: dict) -> None:
    torch.manual_seed(0)
    model = GPT(small(**kw)).eval()
    x = torch.randn(2, 16, model.cfg.n_embd)
    got = model.blocks[0].attn(x)
    want = reference_attention(model, 0, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_alibi_slopes_known_values() -> None:
    # 8 heads: 1/2, 1/4, ..., 1/256 (Press et al. 2022)
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    # 6 heads: the 4-head slopes, then every other of the 8-head slopes
    s4, s8 = alibi_slopes(4).tolist(), alibi_slopes(8).tolist()
    assert alibi_slopes(6).tolist() == pytest.approx(s4 + s8[0::2][:2])


class _KeepMask(torch.autograd.Function):
    """Saves SDPA's mask for backward as CUDA's memory-efficient kernel does (a broadcast view of it), holding
    it through autograd alone: the CPU's math kernel keeps none."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(mask.expand(out.shape[0], *mask.shape))
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[no-untyped-def, override]
        return grad, None


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective", "meter"])
def test_alibi_bias_is_one_tensor_for_all_blocks_and_micro_batches(monkeypatch: pytest.MonkeyPatch,
                                                                   checkpointing: str) -> None:
    """Each block built its own ALiBi bias; where SDPA keeps it for backward, a bias a block and micro-batch
    stayed alive. SDPA here saves its mask as CUDA's memory-efficient kernel does; two micro-batches run forward
    before either runs backward (as a pipeline does); every call must get the same tensor (seen through weak
    references, so that only autograd keeps them), also under the trainer's saved-tensor meter (which detached
    every saved tensor: a new Python object, so the bias died after each block). Under checkpointing the
    forwards keep none. Losses and gradients bitwise those of a bias built per call; once the graphs are gone no
    bias is left."""
    import weakref

    import dist_llm.model.gpt as gpt
    from dist_llm.model import positions
    from dist_llm.train.saved_tensors import SavedTensorMeter

    sdpa = F.scaled_dot_product_attention
    seen: list[weakref.ref] = []

    def keeping(q, k, v, attn_mask=None, **kw):  # type: ignore[no-untyped-def]
        seen.append(weakref.ref(attn_mask if attn_mask._base is None else attn_mask._base))  # what a saved view keeps
        return _KeepMask.apply(sdpa(q, k, v, attn_mask=attn_mask, **kw), attn_mask)

    monkeypatch.setattr(F, "scaled_dot_product_attention", keeping)
    cfg = small(pos_emb="alibi", n_layer=3, block_size=12)  # (12 tokens: rows padded to 16 elements)
    idx = torch.randint(0, 64, (2, 2, 12), generator=torch.Generator().manual_seed(0))

    def run() -> tuple[list[float], list[torch.Tensor], int]:
        torch.manual_seed(0)
        model = GPT(cfg)
        mode = "none" if checkpointing == "meter" else checkpointing
        model.set_activation_checkpointing(mode)  # type: ignore[arg-type]
        with SavedTensorMeter() if checkpointing == "meter" else contextlib.nullcontext():
            losses = [model(x, x) for x in idx]  # both forwards before either backward
        alive = {id(r()) for r in seen if r() is not None}  # (checkpointed: the forwards keep none)
        for loss in losses:
            loss.backward()
        return [loss.item() for loss in losses], [p.grad for p in model.parameters()], len(alive)

    recomputed = checkpointing in ("full", "selective")
    losses, grads, distinct = run()
    assert len(seen) == (12 if recomputed else 6)  # 3 blocks x 2 micro-batches (and their recomputation)
    assert distinct == (0 if recomputed else 1)
    assert len(positions._ALIBI_BIASES) == 0  # freed with the graphs: nothing held between steps
    seen.clear()
    monkeypatch.setattr(gpt, "shared_alibi_bias",
                        lambda slopes, values, T, dtype: positions.alibi_bias(slopes, T, dtype))
    ref_losses, ref_grads, ref_distinct = run()
    assert ref_distinct == (0 if recomputed else 6)  # one a block and micro-batch, all alive until backward
    assert losses == ref_losses
    for a, b in zip(grads, ref_grads, strict=True):
        assert torch.equal(a, b)


def test_alibi_bias_sharing_keys_and_inference_mode() -> None:
    """A bias is shared only by callers of the same slopes (a tensor-parallel rank's heads), dtype, device and
    length; its rows are padded to a multiple of 8 elements (CUDA's memory-efficient kernel copies an unaligned
    bias at each call); the slopes' values are read again after an in-place write; a bias made in inference mode is never
    handed to a training forward (which could not save it for backward)."""
    from dist_llm.model.positions import SlopeValues, alibi_bias, shared_alibi_bias

    s8 = alibi_slopes(8)
    low, high = s8[:4], s8[4:]  # tensor-parallel ranks 0 and 1 of 8 heads
    values = SlopeValues()

    def shared(slopes: torch.Tensor, T: int = 12, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return shared_alibi_bias(slopes, SlopeValues(), T, dtype)

    def same(x: torch.Tensor, y: torch.Tensor) -> bool:
        return x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()

    a = shared(low)  # (held: while it lives its storage is no other tensor's)
    assert same(shared(low.clone()), a)  # another block's slopes buffer
    assert a.shape == (4, 12, 12) and a.stride() == (12 * 16, 16, 1)
    others = [shared(high), shared(low, T=8), shared(low, dtype=torch.bfloat16), shared(low.bfloat16())]
    assert not any(same(other, a) for other in others)
    assert torch.equal(shared(high), alibi_bias(high, 12, torch.float32))
    slopes = low.clone()
    assert same(shared_alibi_bias(slopes, values, 12, torch.float32), a)
    slopes.mul_(2)  # (as reset_buffers writes the buffer in place)
    doubled = shared_alibi_bias(slopes, values, 12, torch.float32)
    assert not same(doubled, a) and torch.equal(doubled, alibi_bias(slopes, 12, torch.float32))
    del a, others
    with torch.inference_mode():
        made = shared(low)
    assert made.is_inference()
    got = shared(low)
    assert not got.is_inference() and not same(got, made)


def test_an_alibi_model_compiles_whole_runs_in_inference_mode_and_pickles_after_a_forward() -> None:
    """What the shared bias must not break (each broke with the slopes' values read before the compile and
    inference checks, or held in a pickled attribute): a block traced by Dynamo in one graph; a model built and
    run in inference mode (its slopes keep no version counter); a model saved with torch.save or pickled after a
    forward, and the copy runs with the same output."""
    import io
    import pickle

    import torch._dynamo

    cfg = small(pos_emb="alibi", n_layer=1)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(GPT(cfg).blocks[0])(torch.randn(2, 16, 32, requires_grad=True))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert GPT(cfg)(idx).shape == (2, 16, 64)
    model = GPT(cfg)
    out = model(idx)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for copy in (torch.load(buffer, weights_only=False), pickle.loads(pickle.dumps(model))):
        assert torch.equal(copy(idx), out)


def test_rope_is_relative() -> None:
    """q.k after RoPE depends only on the distance between positions."""
    torch.manual_seed(0)
    model = GPT(small(pos_emb="rope"))
    q = torch.randn(1, 1, 1, 8).expand(1, 1, 16, 8).contiguous()
    k = torch.randn(1, 1, 1, 8).expand(1, 1, 16, 8).contiguous()
    qr, kr = model.rope(q, k)
    dots = (qr[0, 0] @ kr[0, 0].T)  # (T, T)
    torch.testing.assert_close(dots[5, 3], dots[12, 10])
    torch.testing.assert_close(dots[7, 7], dots[0, 0])


@pytest.mark.parametrize("kw", [dict(), dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=2, bias=False,
                                             tie_embeddings=False)], ids=["gpt2", "llama"])
def test_shapes_and_loss(kw: dict) -> None:
    torch.manual_seed(0)
    model = GPT(small(**kw))
    idx = torch.randint(0, 64, (3, 16))
    logits = model(idx)
    assert logits.shape == (3, 16, 64)
    targets = torch.randint(0, 64, (3, 16))
    loss = model(idx, targets)
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    # at init the prediction is near uniform: loss close to ln(vocab)
    assert abs(loss.item() - math.log(64)) < 0.1


def test_causal() -> None:
    """Changing a later token never changes earlier logits."""
    torch.manual_seed(0)
    for pos_emb in ("learned", "rope", "alibi"):
        model = GPT(small(pos_emb=pos_emb)).eval()
        a = torch.randint(0, 64, (1, 16))
        b = a.clone()
        b[0, 10] = (b[0, 10] + 1) % 64
        torch.testing.assert_close(model(a)[:, :10], model(b)[:, :10])


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_gives_identical_grads(mode: str) -> None:
    torch.manual_seed(0)
    cfg = small(pos_emb="rope", dropout=0.1)
    idx = torch.randint(0, 64, (2, 16))

    def grads(checkpointing: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        torch.manual_seed(1)
        model = GPT(cfg)
        model.set_activation_checkpointing(checkpointing)  # type: ignore[arg-type]
        torch.manual_seed(2)  # same dropout masks: checkpoint replays the RNG state on recompute
        loss = model(idx, idx)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    loss0, g0 = grads("none")
    loss1, g1 = grads(mode)
    assert loss0.item() == loss1.item()
    assert g0.keys() == g1.keys()
    for name in g0:
        torch.testing.assert_close(g0[name], g1[name], rtol=0, atol=0, msg=name)


def test_checkpointing_keeps_parameter_names() -> None:
    model = GPT(small())
    names = [n for n, _ in model.named_parameters()]
    for mode in ("full", "selective", "none"):
        model.set_activation_checkpointing(mode)  # type: ignore[arg-type]
        assert [n for n, _ in model.named_parameters()] == names


def test_tied_embeddings_and_param_count() -> None:
    cfg = small()
    tied = GPT(cfg)
    assert tied.lm_head.weight is tied.wte.weight
    C, V, L, T = cfg.n_embd, cfg.padded_vocab, cfg.n_layer, cfg.block_size
    assert V == 128  # 64 padded up to pad_vocab_to
    per_block = (2 * 2 * C) + (C * 3 * C + 3 * C) + (C * C + C) + (C * 4 * C + 4 * C) + (4 * C * C + C)
    expected = V * C + T * C + L * per_block + 2 * C
    assert tied.num_params() == expected
    untied = GPT(small(tie_embeddings=False))
    assert untied.num_params() == expected + V * C
    assert tied.num_params(non_embedding=True) == expected - T * C
    assert tied.flops_per_token() == 6 * (expected - T * C) + 12 * L * C * T


def test_init_scales_residual_projections() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=8, n_head=4, n_embd=256, vocab_size=256, block_size=32)
    model = GPT(cfg)
    assert model.blocks[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks[0].mlp.down.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert model.blocks[0].attn.qkv.bias.abs().sum().item() == 0


def test_seeded_init_is_reproducible() -> None:
    torch.manual_seed(3)
    a = GPT(small())
    torch.manual_seed(3)
    b = GPT(small())
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_generate_appends_tokens() -> None:
    torch.manual_seed(0)
    model = GPT(small()).eval()
    out = model.generate(torch.zeros(1, 3, dtype=torch.long), 20, top_k=5)  # longer than block_size: cropped
    assert out.shape == (1, 23)
    greedy = model.generate(torch.zeros(1, 3, dtype=torch.long), 5, temperature=0)
    assert torch.equal(greedy, model.generate(torch.zeros(1, 3, dtype=torch.long), 5, temperature=0))


def test_bf16_autocast_forward_backward() -> None:
    torch.manual_seed(0)
    model = GPT(small(pos_emb="rope", n_kv_head=2))
    idx = torch.randint(0, 64, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(idx, idx)
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    ref = GPT(small(pos_emb="rope", n_kv_head=2))
    ref.load_state_dict(model.state_dict())
    assert abs(ref(idx, idx).item() - loss.item()) < 2e-2
