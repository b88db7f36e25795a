"""Mixture of Experts at one process: router, balancing losses, grouped experts against a token-by-token
reference, capacity, shared experts, the aux-loss-free bias, training through the Trainer, config rules; and
data parallelism (DDP, ZeRO-1/2) equal to one process."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dist_llm.config import Config, ConfigError, ModelConfig, load_config
from dist_llm.model.gpt import GPT, MLP
from dist_llm.model.moe import MoE, aux_loss, route, take_metrics, update_expert_bias, z_loss
from dist_llm.parallel.context import ParallelContext
from dist_llm.train.trainer import Trainer
from tests.conftest import tiny_overrides
from tests.distributed import run_distributed
from tests.test_data_parallel import assert_same_run, corpus, reference, train  # noqa: F401 - corpus is a fixture

E1 = math.e


def test_route_orders_and_selection_bias() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    probs = logits.softmax(-1)
    w, ids, p = route(logits, 2, "topk_softmax")
    assert ids.tolist() == [[2, 1]]
    torch.testing.assert_close(w, torch.tensor([[E1 / (E1 + 1), 1 / (E1 + 1)]]))  # softmax over (3, 2)
    torch.testing.assert_close(p, probs)
    w, ids, _ = route(logits, 2, "softmax_topk")
    assert ids.tolist() == [[2, 1]]
    torch.testing.assert_close(w, probs[:, [2, 1]])  # the probabilities as they are, not renormalised
    # the bias picks expert 0 instead of 1, but the weights come from the unbiased scores
    w, ids, _ = route(logits, 2, "topk_softmax", bias=torch.tensor([1.5, 0.0, 0.0, 0.0]))
    assert ids.tolist() == [[2, 0]]
    torch.testing.assert_close(w, torch.tensor([[E1 ** 2 / (E1 ** 2 + 1), 1 / (E1 ** 2 + 1)]]))  # softmax over (3, 1)
    w, ids, _ = route(logits, 1, "softmax_topk", bias=torch.tensor([0.0, 0.0, 0.0, 0.9]))
    assert ids.tolist() == [[3]] and w.item() == pytest.approx(probs[0, 3].item())


def test_aux_and_z_loss_by_hand() -> None:
    probs = torch.tensor([[0.7, 0.3], [0.6, 0.4]])
    # k=1, both tokens to expert 0: f = (1, 0), P = (0.65, 0.35): 2 * (1 * 0.65) = 1.3
    assert aux_loss(probs, torch.tensor([[0], [0]]), 2).item() == pytest.approx(1.3)
    # one token each: f = (0.5, 0.5): 2 * (0.5 * 0.65 + 0.5 * 0.35) = 1 (balanced)
    assert aux_loss(probs, torch.tensor([[0], [1]]), 2).item() == pytest.approx(1.0)
    # k=2 over 3 experts: assignments (0,1), (0,2): f = (2/4, 1/4, 1/4)
    p3 = torch.tensor([[0.5, 0.3, 0.2], [0.4, 0.1, 0.5]])
    want = 3 * (0.5 * 0.45 + 0.25 * 0.2 + 0.25 * 0.35)
    assert aux_loss(p3, torch.tensor([[0, 1], [0, 2]]), 3).item() == pytest.approx(want)
    logits = torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    lse = [math.log(2.0), math.log(E1 + E1 ** 2)]
    assert z_loss(logits).item() == pytest.approx((lse[0] ** 2 + lse[1] ** 2) / 2)


def _moe(mlp: str, order: str, *, shared: int = 0, capacity: float = 0.0, impl: str = "grouped_mm",
         experts: int = 4, top_k: int = 2) -> tuple[MoE, ModelConfig]:
    cfg = ModelConfig(n_embd=16, n_head=2, n_experts=experts, moe_top_k=top_k, moe_hidden=24, mlp=mlp,
                      moe_router_order=order, n_shared_experts=shared, moe_capacity_factor=capacity)
    torch.manual_seed(0)
    layer = MoE(cfg, MLP(cfg, _plain(), hidden=shared * 24) if shared else None, torch.nn.Identity())
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)  # (activations of order one: 1e-6 is fp32 rounding)
    layer.experts.impl = impl
    return layer, cfg


def _plain():  # type: ignore[no-untyped-def]
    from dist_llm.model.factory import LayerFactory
    return LayerFactory()


def reference_moe(layer: MoE, x: torch.Tensor, order: str, top_k: int) -> torch.Tensor:
    """Token by token, expert by expert, written out plainly."""
    ex = layer.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        logits = x[t] @ layer.router.weight.T  # (E,)
        if order == "topk_softmax":
            chosen = torch.topk(logits, top_k).indices
            gates = torch.softmax(logits[chosen], dim=0)
        else:
            probs = torch.softmax(logits, dim=0)
            chosen = torch.topk(probs, top_k).indices
            gates = probs[chosen]
        for gate, e in zip(gates, chosen.tolist()):
            up = x[t] @ ex.w_up[e] + ex.b_up[e]
            if ex.w_gate is not None:
                h = F.silu(x[t] @ ex.w_gate[e] + ex.b_gate[e]) * up
            else:
                h = F.gelu(up, approximate="tanh")
            out[t] = out[t] + gate * (h @ ex.w_down[e] + ex.b_down[e])
        if layer.shared is not None:
            out[t] = out[t] + layer.shared(x[t])
    return out


@pytest.mark.parametrize("impl", ["auto", "grouped_mm", "loop", "bmm"])
@pytest.mark.parametrize("mlp,order,shared", [("gelu", "topk_softmax", 0), ("swiglu", "softmax_topk", 1),
                                              ("swiglu", "topk_softmax", 2)])
def test_dropless_matches_token_loop(impl: str, mlp: str, order: str, shared: int) -> None:
    layer, _ = _moe(mlp, order, shared=shared, impl=impl)
    x = torch.randn(3, 7, 16)
    x_ref = x.clone().requires_grad_()
    x.requires_grad_()
    got = layer(x)
    grad_out = torch.randn_like(got)
    got.backward(grad_out)
    got_grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    want = reference_moe(layer, x_ref.view(-1, 16), order, 2).view(3, 7, 16)
    want.backward(grad_out)
    # fp32, summed in another order: rounding only
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    for n, p in layer.named_parameters():
        torch.testing.assert_close(got_grads[n], p.grad, rtol=1e-6, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def test_capacity_drops_overflow_tokens_in_order() -> None:
    layer, _ = _moe("gelu", "topk_softmax", capacity=1.0, experts=4, top_k=1)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 1.0  # x[..., 0] > 0 sends every token to expert 0
    x = torch.randn(1, 8, 16)
    x[..., 0] = 5.0
    layer.train()
    out = layer(x)
    # capacity ceil(1.0 * 8 * 1 / 4) = 2: tokens 0 and 1 reach expert 0, the other 6 are dropped (zero output)
    want = reference_moe(layer, x.view(-1, 16), "topk_softmax", 1).view(1, 8, 16)
    torch.testing.assert_close(out[0, :2], want[0, :2], rtol=1e-6, atol=1e-6)
    assert out[0, 2:].abs().max().item() == 0.0
    metrics = take_metrics([layer])
    assert metrics["moe_dropped_fraction"] == pytest.approx(6 / 8)
    assert metrics["moe_imbalance"] == pytest.approx(4.0)  # 8 tokens on one of 4 experts: max/mean = 8/2
    # the counts before the capacity, exact, one list per layer; and each layer's figure beside the worst
    assert metrics["moe_tokens_per_expert"] == [[8, 0, 0, 0]] and metrics["moe_layer_imbalance"] == [4.0]
    assert take_metrics([layer]) == {}  # the sums were reset: no forward since, nothing to report
    # a generous capacity drops nothing and equals the dropless layer
    layer.capacity_factor = 4.0
    torch.testing.assert_close(layer(x), want, rtol=1e-6, atol=1e-6)
    assert take_metrics([layer])["moe_dropped_fraction"] == 0.0


def test_take_metrics_runs_its_collectives_whatever_this_rank_recorded() -> None:
    """Under pp a stage can list a layer it has not run since the last log step beside stand-ins for the others':
    every rank still issues the same two all-reduces (NCCL would hang on a rank that skipped them), and the
    sums decide. Before, a first layer without records returned before the collectives."""
    layer, _ = _moe("gelu", "topk_softmax", experts=4, top_k=1)
    calls: list[torch.dtype] = []
    assert take_metrics([layer], all_reduce=lambda t: calls.append(t.dtype)) == {}
    assert calls == [torch.float32, torch.int64]  # (the counts travel as integers: exact at any size)

    def other_rank_ran_it(t: torch.Tensor) -> None:  # the sum over two ranks, the other of which ran 8 tokens
        if t.dtype == torch.int64:
            t += torch.tensor([[2, 2, 4, 0]])
        else:
            t[:, 3] += 1

    metrics = take_metrics([layer], all_reduce=other_rank_ran_it)
    assert metrics["moe_tokens_per_expert"] == [[2, 2, 4, 0]] and metrics["moe_layer_imbalance"] == [2.0]


def test_bias_update_moves_toward_balance() -> None:
    layer, _ = _moe("gelu", "topk_softmax", experts=4, top_k=1)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 0.1  # every token prefers expert 0, by a margin of 0.5 (x[..., 0] = 5)
    x = torch.randn(1, 16, 16)
    x[..., 0] = 5.0
    layer.train()
    loads = []
    for _ in range(8):
        layer(x)
        loads.append(layer.step_load.clone())
        update_expert_bias([layer], 0.1)
    assert loads[0].tolist() == [16.0, 0.0, 0.0, 0.0]
    # bias += 0.1 * sign(mean - load): -0.1 for expert 0, +0.1 for the others, until expert 0 loses its margin
    assert layer.expert_bias[0].item() < 0 < layer.expert_bias[1].item()
    assert loads[-1][0].item() < 16.0 and layer.step_load is None
    # rate 0: nothing moves
    before = layer.expert_bias.clone()
    layer(x)
    update_expert_bias([layer], 0.0)
    assert torch.equal(layer.expert_bias, before)


@pytest.mark.parametrize("cast", ["to", "bfloat16", "half", "buffer_dtype"])
def test_expert_bias_stays_fp32_whatever_casts_the_layer(cast: str) -> None:
    """`.to(bf16)`, `.bfloat16()`, `.half()` (DeepSpeed's engine up to 0.19.1) cast the parameters, not the aux-free
    bias; a cast through `.data` (DeepSpeed's data_types.buffer_dtype) followed by a device move is undone by
    `fp32_buffers_kept`. The bias keeps its fp32 values and the next update is the fp32 layer's, to the bit."""
    from dist_llm.model.buffers import fp32_buffers_kept

    layer, _ = _moe("gelu", "topk_softmax")
    ref, _ = _moe("gelu", "topk_softmax")
    bias = torch.tensor([1.0, -0.5, 0.25, 0.0]) + 0.001 * torch.arange(1, 5)  # (a few hundred steps of 0.001)
    assert not torch.equal(bias.bfloat16().float(), bias) and not torch.equal(bias.half().float(), bias)  # premise
    for m in (layer, ref):
        m.expert_bias.copy_(bias)
    if cast == "to":
        layer.to(torch.bfloat16)
    elif cast == "buffer_dtype":
        with fp32_buffers_kept(layer):
            for b in layer.buffers():
                b.data = b.data.to(torch.bfloat16)  # (as DeepSpeed 0.19.8's engine casts buffers)
            layer.to("cpu")  # (and then moves the module: the bias goes through _apply already rounded)
    else:
        getattr(layer, cast)()
    assert cast == "buffer_dtype" or layer.router.weight.dtype != torch.float32  # the parameters were cast
    assert layer.expert_bias.dtype == torch.float32 and torch.equal(layer.expert_bias, bias)
    assert list(layer.state_dict()).index("expert_bias") == list(ref.state_dict()).index("expert_bias")
    load = torch.tensor([[3.0, 1.0, 0.0, 4.0]])
    for m in (layer, ref):
        m.step_load = load[0].clone()
    update_expert_bias([layer], 0.001)
    update_expert_bias([ref], 0.001)
    assert torch.equal(layer.expert_bias, ref.expert_bias) and not torch.equal(ref.expert_bias, bias)


def test_gpt_blocks_params_and_flops() -> None:
    cfg = ModelConfig(n_layer=4, n_embd=32, n_head=2, n_experts=4, moe_top_k=1, moe_every=2, bias=False, mlp="swiglu")
    model = GPT(cfg)
    assert [hasattr(b, "moe") for b in model.blocks] == [False, True, False, True]  # i % 2 == 1
    per_expert = 3 * 32 * cfg.ffn_hidden
    assert model.num_params() - model.num_params(active=True) == 2 * 3 * per_expert  # 3 idle experts x 2 layers
    dense = GPT(ModelConfig(n_layer=4, n_embd=32, n_head=2, bias=False, mlp="swiglu"))
    # top-1 with the dense hidden: a token meets the dense model's parameters plus the two routers
    assert model.flops_per_token() == dense.flops_per_token() + 6 * 2 * 32 * 4
    # one name -> one value at any build: the init does not depend on the process's random state
    torch.manual_seed(1)
    a = GPT(cfg)
    a.reset_parameters(seed=7)
    torch.manual_seed(2)
    b = GPT(cfg)
    b.reset_parameters(seed=7)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    assert a.blocks[1].moe.experts.w_down.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.05)


def test_loss_is_the_lm_loss_and_gradient_carries_balancing() -> None:
    cfg = ModelConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, n_experts=4, moe_aux_loss_coef=0.5,
                      moe_z_loss_coef=0.1)
    torch.manual_seed(0)
    model = GPT(cfg)
    x = torch.randint(0, 256, (2, 16))
    loss = model(x, x, reduction="sum")
    assert loss.item() == model.loss(model(x), x, reduction="sum").item()  # the value: the LM loss alone
    loss.backward()
    with_aux = model.blocks[0].moe.router.weight.grad.clone()
    model.zero_grad()
    for m in (b.moe for b in model.blocks):
        m.aux_coef = m.z_coef = 0.0
    model(x, x, reduction="sum").backward()
    assert not torch.allclose(with_aux, model.blocks[0].moe.router.weight.grad)


def test_trainer_trains_and_logs(tmp_path: Path, corpus_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "run"
    cfg = load_config(None, tiny_overrides(out, data__source=str(corpus_file), train__max_steps=12,
                                           model__n_experts=4, model__moe_top_k=2, model__moe_bias_update_rate=0.01,
                                           model__moe_z_loss_coef=0.001, model__moe_capacity_factor=1.25,
                                           train__eval_interval=6))
    with caplog.at_level(logging.INFO, logger="dist_llm"):
        Trainer(cfg, ParallelContext.from_config(cfg)).fit()
    # the first line and the start record state the ep layout at ep=1 too
    assert "| world 1 (dp 1, tp 1, pp 1, ep 1: 4 of 4 experts a rank) |" in caplog.text
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["n_active_params"] < records[0]["n_params"]
    assert records[0]["layout"] == {"world_size": 1, "dp": 1, "tp": 1, "pp": 1, "ep": 1}
    assert records[0]["moe_blocks"] == list(range(cfg.model.n_layer))  # (every block MoE: moe_every 1)
    assert "- world size 1: dp 1 x cp 1 x pp 1 x tp 1 (mesh order dp, cp, pp, tp), ep 1 (experts split over ep of the dp ranks)" \
        in (out / "report.md").read_text()
    steps = [r for r in records if "loss" in r]
    assignments = cfg.train.global_batch_size * cfg.model.block_size * cfg.model.moe_top_k  # a step's, a layer's
    for before, r in zip([0] + [s["step"] for s in steps], steps):
        assert 0 < r["moe_aux_loss"] < 4  # (1 when selection and probabilities are both uniform; at most E)
        assert r["moe_z_loss"] > 0 and r["moe_imbalance"] >= 1.0 and 0.0 <= r["moe_dropped_fraction"] < 1.0
        # every training forward's assignments since the last log step, before the capacity; evaluation none
        tokens = r["moe_tokens_per_expert"]
        assert len(tokens) == cfg.model.n_layer and all(len(t) == 4 for t in tokens)
        assert [sum(t) for t in tokens] == [assignments * (r["step"] - before)] * cfg.model.n_layer
        assert r["moe_layer_imbalance"] == [round(max(t) / (sum(t) / 4), 4) for t in tokens]
        assert r["moe_imbalance"] == max(r["moe_layer_imbalance"])
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5


def test_dense_fingerprint_unchanged() -> None:
    # the hash a dense model had before the MoE keys existed (a checkpoint's shape check must still accept it)
    import dataclasses
    import hashlib
    cfg = Config()
    old = {k: v for k, v in dataclasses.asdict(cfg.model).items()
           if k not in ("init_from", "n_experts", "qkv_bias") and not k.startswith(("moe_", "n_shared_"))}
    assert cfg.fingerprint() == hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:16]
    assert load_config(None, ["model.n_experts=4"]).fingerprint() != cfg.fingerprint()


@pytest.mark.parametrize("override,message", [
    (["model.moe_top_k=5"], "model.moe_top_k: must be in [1, model.n_experts=4], got 5"),
    (["model.moe_every=9"], "model.moe_every: must be in [1, model.n_layer=4], got 9"),
    (["model.moe_capacity_factor=-1"], "model.moe_capacity_factor: must be >= 0, got -1"),
    (["model.moe_router_order=sorted"], "model.moe_router_order"),
])
def test_config_errors(override: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.n_experts=4", *override])
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_data_parallel_matches_single_process(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                              corpus: Path, zero_stage: int) -> None:
    moe = {"model__n_experts": 4, "model__moe_z_loss_coef": 0.001, "model__moe_bias_update_rate": 0.01,
           "model__n_shared_experts": 1}
    got = run_distributed(train, 2, tmp_path, corpus, {"parallel__zero_stage": zero_stage, **moe},
                          init_group=False)[0]
    ref = reference(tmp_path_factory, corpus, **moe)
    assert_same_run(got, ref, rtol=1e-5)
    for a, b in zip(got["records"], ref["records"], strict=True):  # the balancing figures are global too
        assert a["moe_imbalance"] == pytest.approx(b["moe_imbalance"], rel=1e-5)
        assert a["moe_aux_loss"] == pytest.approx(b["moe_aux_loss"], rel=1e-5)


def test_resume_restores_the_expert_bias(tmp_path: Path, corpus_file: Path) -> None:
    def make(out: Path, **extra: object) -> Trainer:
        cfg = load_config(None, tiny_overrides(out, data__source=str(corpus_file), train__max_steps=8,
                                               train__ckpt_interval=4, train__eval_interval=0, model__n_experts=4,
                                               model__moe_bias_update_rate=0.05, **extra))
        return Trainer(cfg, ParallelContext.from_config(cfg))

    def losses(out: Path) -> dict[int, float]:
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in records if "loss" in r}

    whole = make(tmp_path / "a")
    whole.fit()
    make(tmp_path / "b", train__stop_after_step=4).fit()
    resumed = make(tmp_path / "b")
    assert resumed.step == 4 and resumed.moe_layers[0].expert_bias.abs().sum() > 0  # (the bias came back)
    resumed.fit()
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert [b[s] for s in range(5, 9)] == [a[s] for s in range(5, 9)]  # bit-identical after the resume point
    for la, lb in zip(whole.moe_layers, resumed.moe_layers):
        assert torch.equal(la.expert_bias, lb.expert_bias)


def test_hf_export_family_of_moe() -> None:
    """configs/moe.yaml exports as Mixtral (tests/test_hf_moe.py checks the logits); what neither Mixtral nor
    Qwen2-MoE can hold is refused in one line."""
    import dataclasses

    from dist_llm.hf import export_family
    cfg = load_config(Path(__file__).parents[1] / "configs" / "moe.yaml").model
    assert export_family(cfg) == "mixtral"
    with pytest.raises(ConfigError, match=r"^model.n_experts=8: this MoE model exports as neither Mixtral nor "
                                          r"Qwen2-MoE \(Mixtral needs model.n_shared_experts=0; Qwen2-MoE needs "
                                          r"model.moe_shared_gate=true\)$"):
        export_family(dataclasses.replace(cfg, n_shared_experts=1))


def test_an_fp32_moe_layer_compiles() -> None:
    """train.compile with an fp32 MoE model crashed in Dynamo: torch 2.13's fake-tensor rule for torch._grouped_mm
    takes bf16 alone, so under compilation fp32 experts take the per-expert loop (model/moe.py `pick_impl`).
    The eager backend runs the traced graph with the same kernels, so the results agree to the last bit or two."""
    torch.manual_seed(0)
    cfg = ModelConfig(n_embd=32, n_experts=4, moe_top_k=2, moe_hidden=64, mlp="swiglu", bias=False)
    layer = MoE(cfg, None, torch.nn.Identity())
    for p in layer.parameters():  # (the experts' stacks are made empty: the GPT's init fills them)
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 8, 32, requires_grad=True)
    eager = layer(x)
    (g_eager,) = torch.autograd.grad(eager.square().sum(), x)
    compiled = torch.compile(layer, backend="eager")(x)
    (g_compiled,) = torch.autograd.grad(compiled.square().sum(), x)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g_compiled, g_eager, rtol=1e-6, atol=1e-6)


def test_the_per_expert_loop_runs_eagerly_under_compile() -> None:
    """Under torch.compile fp32 experts take the per-expert loop, which reads the counts on the host: traced, it
    specialised the graph on each routing's sizes (a recompile per new routing up to Dynamo's limit, then
    silently eager). Now it runs outside the graph: after two warm-up calls (the first fills `stats`, a guard
    of its own) new routings compile nothing, and the outputs equal eager's."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    cfg = ModelConfig(n_embd=32, n_experts=4, moe_top_k=2, moe_hidden=64, mlp="swiglu", bias=False)
    layer = MoE(cfg, None, torch.nn.Identity())
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, backend="eager")
    loads, graphs, seen = set(), [], torch.zeros(4)
    for seed in range(6):
        x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(compiled(x), layer(x), rtol=1e-6, atol=1e-6)  # (the same kernels: 1e-6)
        graphs.append(counters["stats"]["unique_graphs"])
        loads.add(tuple((layer.stats["load"] - seen).tolist()))  # (this input's tokens per expert, twice)
        seen = layer.stats["load"].clone()
    torch._dynamo.reset()
    assert len(loads) >= 4  # new routings, not one repeated
    assert graphs[1] == graphs[-1], graphs  # (it grew to the 4th call before: 14, 16, 18)
