"""LoRA on MoE models: on attention, on the dense and shared-expert MLPs, and per expert on the routed experts.

The expert-parallel run is compared with one process in fp32 at 1e-5: the same tokens meet the same experts
with the same base and LoRA weights; only where each expert's rows are computed and the order of the gradient
sums change (an expert LoRA's gradient sums over the ep ranks in the all-to-all's backward, then over the
expert-dp group), so the two differ by the rounding of reordered float sums alone."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_llm.config import ConfigError, load_config
from dist_llm.model import GPT
from dist_llm.parallel.context import ParallelContext
from dist_llm.peft import apply_peft, expert_loras, merge, merge_into_base, parameter_counts, trainable_names, unmerge
from tests.conftest import tiny_overrides
from tests.distributed import run_distributed
from tests.test_pipeline import merged
from tests.test_data_parallel import STEPS, assert_same_run, corpus, reference, train  # noqa: F401 - corpus: fixture

TARGETS = "[qkv, attn_out, mlp_up, mlp_down, experts_up, experts_down]"
# SwiGLU (so experts_up means w_up and w_gate), block 0 dense and block 1 MoE with a shared expert
MOE = {"model__n_experts": 4, "model__moe_top_k": 2, "model__moe_every": 2, "model__n_shared_experts": 1,
       "model__mlp": "swiglu", "model__moe_z_loss_coef": 0.001}
LORA = {**MOE, "peft__method": "lora", "peft__targets": TARGETS, "peft__rank": 4, "optim__lr": 1e-2}


def _build(tmp_path: Path, **extra: Any) -> GPT:
    from dist_llm.train.trainer import build_model

    cfg = load_config(None, tiny_overrides(tmp_path, model__bias=False, **extra))
    return build_model(cfg, ParallelContext.from_config(cfg))


def _idx() -> torch.Tensor:
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))


def test_starts_as_the_base_trains_lora_alone_and_counts_by_hand(tmp_path: Path) -> None:
    base = _build(tmp_path, **MOE)
    model = _build(tmp_path, **LORA)  # the same seeded base, then LoRA
    torch.testing.assert_close(model(_idx()), base(_idx()), rtol=0, atol=0)  # every B = 0: the first loss is the base's
    names = trainable_names(model)
    assert all(".lora" in n for n in names) and not any("router" in n for n in names)  # the router stays frozen
    model(_idx()).sum().backward()
    assert {n for n, p in model.named_parameters() if p.grad is not None} == set(names)
    m, r = model.cfg, 4
    C, H, S, F, E = m.n_embd, m.moe_expert_hidden, m.moe_shared_expert_hidden, m.ffn_hidden, m.n_experts
    attention = r * (C + 3 * C) + r * (C + C)  # qkv (r x C and 3C x r), attn_out
    swiglu = lambda hidden: 2 * r * (C + hidden) + r * (hidden + C)  # noqa: E731 - up and gate, down
    routed = E * swiglu(H)  # one (A_e, B_e) per expert and projection
    assert parameter_counts(model).trainable == 2 * attention + swiglu(F) + swiglu(S) + routed
    assert model.blocks[1].moe.experts.lora_up.A.shape == (E, C, r)
    assert model.blocks[1].moe.experts.lora_down.B.shape == (E, r, C)


def test_merge_per_expert_equals_the_grouped_update(tmp_path: Path) -> None:
    """With random B, the grouped compute's x_e W_e + scale (x_e A_e) B_e equals the merged W_e + scale A_e B_e
    (bmm), and `merge_into_base` leaves a plain MoE GPT with those logits."""
    model = _build(tmp_path, **LORA)
    with torch.no_grad():
        for _, _, lora in expert_loras(model):
            lora.B.normal_(std=0.1)
    adapted = model(_idx())
    merge(model)
    torch.testing.assert_close(model(_idx()), adapted, rtol=1e-5, atol=1e-5)
    unmerge(model)
    torch.testing.assert_close(model(_idx()), adapted, rtol=1e-5, atol=1e-5)
    merge_into_base(model)
    assert not any("lora" in n for n, _ in model.named_parameters())
    torch.testing.assert_close(model(_idx()), adapted, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rank", [2, 4, 8])
def test_any_rank_in_bf16(tmp_path: Path, rank: int) -> None:
    """torch._grouped_mm wants 16-byte rows: r=2 in fp32 and r=4 in bf16 failed in forward; they take the
    per-expert loop. Under bf16 autocast the LoRA model stays near its fp32 self (a bf16 rounding, not a bug)."""
    model = _build(tmp_path, **{**LORA, "peft__rank": rank})
    with torch.no_grad():
        for _, _, lora in expert_loras(model):
            lora.B.normal_(std=0.1)
    full = model(_idx())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = model(_idx())
    half.float().sum().backward()
    assert all(lora.A.grad is not None for _, _, lora in expert_loras(model))
    assert (half.float() - full).abs().max() < 0.05 * full.abs().max()


def test_adapters_on_an_moe_model_start_as_the_base(tmp_path: Path) -> None:
    base = _build(tmp_path, **MOE)
    model = _build(tmp_path, **MOE, peft__method="adapter", peft__rank=8)
    assert hasattr(model.blocks[1].moe, "adapter") and hasattr(model.blocks[0].mlp, "adapter")
    torch.testing.assert_close(model(_idx()), base(_idx()), rtol=0, atol=0)


@pytest.mark.parametrize("zero_stage", [0, 2], ids=["ddp", "zero2"])
def test_expert_parallel_lora_matches_one_process(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                  corpus: Path, zero_stage: int) -> None:  # noqa: F811
    """dp=2 ep=2: 8 steps equal one process; the base (experts included) ends bit-identical to the seeded start
    on every rank (DDP broadcast rank 0's base experts over rank 1's before they were left out of it); the
    rank counts its frozen base once (the two ZeRO forms each counted it). From the ZeRO-2 run: the checkpoint,
    saved by global expert id, resumes at one process, and its merged export has the LoRA model's logits."""
    from dist_llm.convert import load_checkpoint_model, load_full, save_full

    extra = {**LORA, "train__micro_batch_size": 4, "train__ckpt_interval": 4}
    results = run_distributed(train, 2, tmp_path / "run", corpus, {**extra, "parallel__ep": 2,
                                                                   "parallel__zero_stage": zero_stage,
                                                                   "parallel__bucket_mb": 0.01}, init_group=False)
    ref = reference(tmp_path_factory, corpus, **extra)
    assert_same_run(results[0], ref, rtol=1e-5)
    start = {n: p.detach() for n, p in _build(tmp_path / "base", **MOE).named_parameters()}
    for r in results:
        for name, p in start.items():
            assert torch.equal(r["params"][name], p), name
        assert all(r["params"][n].abs().sum() > 0 for n in r["params"] if n.endswith(".B"))  # B moved off zero
        # this rank's parameters (half the experts), the frozen base counted once, not once per ZeRO form (it
        # was), plus ZeRO's bucket padding
        local = sum(p.numel() // (2 if ".experts." in n else 1) for n, p in r["params"].items()) * 4
        assert local <= r["state_bytes"]["params"] <= local + 4096
    if zero_stage == 0:
        return  # (the checkpoint and export below once, from the ZeRO-2 run: they read the same chunks)

    ckpts = tmp_path / "run" / "checkpoints"
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "run", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000008")
    got = train(0, 1, resumed, corpus, {**extra})  # from the ep=2 step-4 checkpoint, at one process
    for a, b in zip(got["losses"][4:], ref["losses"][4:], strict=True):
        assert a == pytest.approx(b, rel=1e-5)

    lora_model = load_checkpoint_model(ckpts / "step_000008")  # the base rebuilt, the LoRA tensors loaded
    merged = load_full(save_full(ckpts / "step_000008", tmp_path / "merged.safetensors"))
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(merged(_idx()), lora_model(_idx()), rtol=1e-5, atol=1e-5)


EXPERTS_ONLY = {"peft__method": "lora", "peft__targets": "[experts_down]", "peft__rank": 4}


@pytest.mark.parametrize("peft,zero_stage", [
    ({"peft__method": "adapter", "peft__rank": 8}, 1),  # no expert tensor trains: the expert ZeRO form has nothing
    (EXPERTS_ONLY, 1),  # only expert tensors train
    (EXPERTS_ONLY, 0),  # DDP has nothing to reduce (it refused to wrap such a model before)
], ids=["adapter", "experts-only", "experts-only-ddp"])
def test_expert_parallel_zero1_with_one_side_frozen(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                    corpus: Path, peft: dict[str, Any],
                                                    zero_stage: int) -> None:  # noqa: F811
    """dp=2 ep=2 ZeRO-1 (or DDP) when all that trains is dense, or all is expert: equal to one process (a ZeRO
    form over no parameters failed the first step before; DDP raised at its build)."""
    extra = {**MOE, **peft, "optim__lr": 1e-2, "train__micro_batch_size": 4}
    results = run_distributed(train, 2, tmp_path, corpus, {**extra, "parallel__ep": 2,
                                                           "parallel__zero_stage": zero_stage}, init_group=False)
    assert_same_run(results[0], reference(tmp_path_factory, corpus, **extra), rtol=1e-5)


@pytest.mark.parametrize("layout", [
    {"parallel__tp": 2},  # whole experts (and their LoRA pairs) on each tp rank, gradients summed over tp
    {"parallel__tp": 2, "parallel__sequence_parallel": True},
    {"parallel__zero_stage": 3, "parallel__ep": 2},  # the LoRA pairs sharded with their experts over expert-dp
    {"parallel__pp": 2},  # block 0 (dense) on stage 0, block 1 (MoE) on stage 1
], ids=["tp2", "tp2-sp", "zero3-ep2", "pp2"])
def test_expert_lora_with_the_other_layouts(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                            corpus: Path, layout: dict[str, Any]) -> None:  # noqa: F811
    """LoRA on attention, the dense and shared MLPs and the routed experts at tp=2 (+SP), ZeRO-3 ep=2 and pp=2
    (world 2 each): 8 steps equal one process (fp32, 1e-5: only where rows are computed and the order of the
    gradient sums change)."""
    extra = {**LORA, "train__micro_batch_size": 4}
    results = run_distributed(train, 2, tmp_path, corpus, {**extra, **layout}, init_group=False)
    got = {**results[0], "params": merged(results)}  # (under pp each stage reports its own blocks)
    assert_same_run(got, reference(tmp_path_factory, corpus, **extra), rtol=1e-5)


@pytest.mark.parametrize("layout", [{"parallel__tp": 2}, {"parallel__tp": 2, "parallel__sequence_parallel": True}],
                         ids=["tp2", "tp2-sp"])
def test_adapters_on_an_moe_model_at_tp(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path,
                                        layout: dict[str, Any]) -> None:  # noqa: F811
    """Adapters on the attention and MoE outputs at tp=2: without SP the MoE's adapter sees the gathered,
    replicated output (its gradient whole on each rank, not summed over tp: it was, giving tp times it), with SP
    the rank's slice (summed). 8 steps equal one process (fp32, 1e-5: the order of the gradient sums)."""
    extra = {**MOE, "peft__method": "adapter", "peft__rank": 8, "optim__lr": 1e-2, "train__micro_batch_size": 4}
    results = run_distributed(train, 2, tmp_path, corpus, {**extra, **layout}, init_group=False)
    assert_same_run({**results[0], "params": merged(results)}, reference(tmp_path_factory, corpus, **extra),
                    rtol=1e-5)


def _replicated_after_dropout(rank: int, world_size: int, out: Path) -> dict[str, torch.Tensor]:
    """A training forward at tp=2 (no SP) with dropout in the model and in the LoRAs: the MoE block's output
    (replicated over tp) and the next draws of the shared stream."""
    from dist_llm.train.trainer import build_model

    # (a capacity: the rows each rank drops, and so the rows it keeps, differ from rank to rank)
    cfg = load_config(None, tiny_overrides(out, **LORA, model__dropout=0.1, peft__dropout=0.1, parallel__tp=2,
                                           model__moe_capacity_factor=1.0))
    model = build_model(cfg, ParallelContext.from_config(cfg))
    seen: dict[str, torch.Tensor] = {}
    model.blocks[1].register_forward_hook(lambda m, i, o: seen.update(block=o.detach()))
    torch.manual_seed(0)  # (the trainer keeps the tp ranks' streams in step; so does this)
    model.train()(_idx())
    return {"block": seen["block"], "next": torch.rand(8)}


def test_expert_lora_dropout_at_tp_keeps_the_shared_stream_in_step(tmp_path: Path) -> None:
    """Each tp rank routes its own tokens (with a capacity, a row count of its own): the expert LoRA's dropout drew from
    the stream the tp ranks share and put it out of step, so every later "replicated" mask differed (here the
    MoE's output dropout). Now it draws from the rank's own stream: what is replicated stays equal."""
    first, second = run_distributed(_replicated_after_dropout, 2, tmp_path)
    torch.testing.assert_close(first["next"], second["next"], rtol=0, atol=0)
    torch.testing.assert_close(first["block"], second["block"], rtol=0, atol=0)


@pytest.mark.parametrize("override,message", [
    (["peft.method=lora", "peft.targets=[qkv, experts_up]"],
     "peft.targets: experts_up needs an MoE model (model.n_experts > 0); a dense model has no experts"),
    (["model.n_experts=4", "peft.method=qlora"],
     "peft.method: qlora has no 4-bit form for an MoE model's stacked experts (model.n_experts > 0); "
     "use peft.method=lora"),
    (["peft.method=lora", "peft.targets=[router]"], None),
])
def test_refusals(override: list[str], message: str | None) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, override)
    if message is None:  # the router is not a target: the key's own check names the choices
        assert "router" in str(err.value) and "experts_up" in str(err.value)
    else:
        assert str(err.value) == message


def test_expert_targets_on_a_dense_model_refused_at_build(tmp_path: Path) -> None:
    """An hf: start's architecture is known only once resolved, after the config checks: apply_peft refuses."""
    from dist_llm.config import PeftConfig

    model = GPT(load_config(None, tiny_overrides(tmp_path)).model)
    with pytest.raises(ConfigError, match=r"^peft.targets: experts_down needs an MoE model \(model.n_experts > 0\)"):
        apply_peft(model, PeftConfig(method="lora", targets=["qkv", "experts_down"]), seed=0)


def test_lora_on_an_hf_mixtral_exports_merged_to_transformers(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    """LoRA on attention and experts of a Mixtral read with `model.init_from=hf:`, 8 steps, `convert --to-hf`:
    transformers' logits of the export equal the LoRA model's (each base tensor read from the Hugging Face
    files, each expert's own update folded in); ATOL as tests/test_hf_moe.py."""
    pytest.importorskip("transformers")
    from dist_llm.convert import convert_checkpoint_to_hf, load_checkpoint_model
    from tests.test_hf import ATOL, VOCAB, hf_logits, max_diff, our_logits
    from tests.test_hf_moe import hf_moe
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    hf_moe("mixtral").save_pretrained(tmp_path / "hf")
    got = train(0, 1, tmp_path / "run", corpus, {"model__init_from": f"hf:{tmp_path / 'hf'}", "peft__method": "lora",
                                                 "peft__targets": "[qkv, experts_up, experts_down]", "peft__rank": 4,
                                                 "optim__lr": 1e-2})
    assert got["losses"][-1] < got["losses"][0]
    convert_checkpoint_to_hf(tmp_path / "run", tmp_path / "out")
    tuned = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    assert max_diff(hf_logits(tuned, tokens), our_logits(load_checkpoint_model(tmp_path / "run"), tokens)) < ATOL


def test_a_pipeline_stage_with_nothing_to_train_refused_in_one_line(tmp_path: Path) -> None:
    """LoRA on the experts alone at pp=2 with block 0 dense: stage 0 trains nothing (its optimizer and gradient
    buffers had no tensor: a traceback at build). Every rank refuses alike, from the config (none waits)."""
    from types import SimpleNamespace

    from dist_llm.parallel.data import _check_every_stage_trains

    cfg = load_config(None, tiny_overrides(tmp_path, model__bias=False, **MOE, **EXPERTS_ONLY, parallel__pp=2))
    with pytest.raises(ConfigError) as err:  # (the check reads no rank: each stage's ranks see the same)
        _check_every_stage_trains(cfg, SimpleNamespace(pp=2))  # type: ignore[arg-type]
    assert str(err.value) == ("peft.targets=['experts_down']: pipeline stage 0 of parallel.pp=2 holds no tensor "
                              "they name, so it has nothing to train; add a target its blocks have, or cut the "
                              "stages (parallel.pp, model.moe_every) so that each holds one")
    every = load_config(None, tiny_overrides(tmp_path, model__bias=False, **{**MOE, "model__moe_every": 1},
                                             **EXPERTS_ONLY, parallel__pp=2))
    _check_every_stage_trains(every, SimpleNamespace(pp=2))  # type: ignore[arg-type]  # (an MoE block on each)
    # build_data_parallel checks it for every form, ZeRO-3 (FSDP2) too (it went on to build FSDP2 before)
    from dist_llm.parallel.data import build_data_parallel

    zero3 = load_config(None, tiny_overrides(tmp_path, model__bias=False, **MOE, **EXPERTS_ONLY, parallel__pp=2,
                                             parallel__zero_stage=3, parallel__dp=2))
    with pytest.raises(ConfigError, match="pipeline stage 0 of parallel.pp=2 holds no tensor"):
        build_data_parallel(None, zero3, SimpleNamespace(pp=2))  # type: ignore[arg-type]


def test_experts_only_lora_under_a_pipeline_at_zero0(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                     corpus: Path) -> None:  # noqa: F811
    """dp=2 pp=2 ep=2 at ZeRO-0 with LoRA on the experts alone (an MoE block on each stage): no dense tensor
    trains, so the flat all-reduce buffer is empty (its dtype read the first of no tensors before); 8 steps
    equal one process."""
    extra = {**MOE, "model__moe_every": 1, **EXPERTS_ONLY, "optim__lr": 1e-2, "train__micro_batch_size": 2}
    results = run_distributed(train, 4, tmp_path, corpus, {**extra, "parallel__pp": 2, "parallel__ep": 2},
                              init_group=False)
    got = {**results[0], "params": merged(results)}
    assert_same_run(got, reference(tmp_path_factory, corpus, **extra), rtol=1e-5)


# The test's own corpus, fixed here (a README edit changed what a corpus made of it checked): runs of one letter and of
# spaces, few distinct bytes, on which both first steps overload the same two experts: after 2 steps every expert's
# bias has moved twice the same way (+-2 x the rate, as measured). On other text two sign steps can cancel: on
# "the router sends every token to an expert. " * 500 every bias comes back exactly 0.
UNEVEN_TEXT = "".join("a" * (i % 7) + " " * (i % 5) + "\n" for i in range(4000))


def test_a_lora_checkpoint_keeps_the_expert_bias(tmp_path: Path) -> None:
    """The aux-free expert bias is state the run trains though it is no parameter: a PEFT checkpoint, which keeps
    the trained tensors only, must keep it too, or a resumed run routes with a bias back at zero (it came back
    zero before) and sampling and export route otherwise than training did."""
    from dist_llm.train.trainer import Trainer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(UNEVEN_TEXT)

    def trainer(steps: int) -> Trainer:
        cfg = load_config(None, tiny_overrides(tmp_path / "run", **{
            "data__source": str(corpus), "train__eval_interval": 0, "model__bias": False, **LORA,
            "model__moe_bias_update_rate": 0.01, "train__max_steps": steps, "train__ckpt_interval": 2}))
        return Trainer(cfg, ParallelContext.from_config(cfg))

    first = trainer(2)
    try:
        first.fit()
        trained = {n: b.clone() for n, b in first.module.named_buffers() if n.endswith("expert_bias")}
    finally:
        first.ctx.destroy()
    assert trained and all(b.abs().sum() > 0 for b in trained.values())  # (a small rate: no flip back to 0)
    second = trainer(3)  # resumes at step 2 as it is built
    try:
        assert second.step == 2
        resumed = {n: b for n, b in second.module.named_buffers() if n.endswith("expert_bias")}
        assert resumed.keys() == trained.keys()
        for name, bias in trained.items():
            assert torch.equal(resumed[name], bias), name
        # a checkpoint written before the bias was kept: it is not asked for (DCP would fail on the missing key)
        old = second.run_state._saved_part(second.dp.checkpoint_state(), held=set(trainable_names(second.module)))
        assert set(old["model"]) == set(trainable_names(second.module))
    finally:
        second.ctx.destroy()
    from dist_llm.convert import load_checkpoint_model  # sampling and export route as training did

    sampled = dict(load_checkpoint_model(tmp_path / "run" / "checkpoints" / "step_000002").named_buffers())
    for name, bias in trained.items():
        assert torch.equal(sampled[name], bias), name


def test_a_lora_export_takes_the_trained_expert_bias_from_the_checkpoint(tmp_path: Path) -> None:
    """`convert --to-full` of a LoRA checkpoint writes the expert bias the run trained, which the checkpoint holds
    (it wrote the base's zeros before), and `--to-hf` refuses it as it refuses a full checkpoint's: Mixtral routes
    without a bias, so the export would route otherwise than training did (it passed the check on those zeros)."""
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open

    from dist_llm.convert import convert_checkpoint_to_hf, save_full
    from dist_llm.train.trainer import Trainer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(UNEVEN_TEXT)
    cfg = load_config(None, tiny_overrides(tmp_path / "run", **{
        "data__source": str(corpus), "train__eval_interval": 0, "train__max_steps": 2, "train__ckpt_interval": 2,
        "model__n_experts": 4, "model__moe_top_k": 2, "model__mlp": "swiglu", "model__pos_emb": "rope",
        "model__norm": "rmsnorm", "model__bias": False, "model__moe_bias_update_rate": 0.01,
        "peft__method": "lora", "peft__targets": "[qkv, experts_up]", "peft__rank": 4}))
    trainer = Trainer(cfg, ParallelContext.from_config(cfg))
    try:
        trainer.fit()
    finally:
        trainer.ctx.destroy()
    step = tmp_path / "run" / "checkpoints" / "step_000002"
    names = [f"blocks.{i}.moe.expert_bias" for i in range(cfg.model.n_layer)]
    saved = {"model": {name: torch.empty(4) for name in names}}
    dcp.load(saved, checkpoint_id=str(step), no_dist=True)  # the checkpoint's own tensors, read by DCP
    assert all(b.any() for b in saved["model"].values())  # (trained: not the base's zeros)

    full = save_full(step, tmp_path / "full.safetensors")
    with safe_open(str(full), framework="pt") as f:
        for name in names:
            assert torch.equal(f.get_tensor(name), saved["model"][name]), name
    with pytest.raises(ConfigError) as e:
        convert_checkpoint_to_hf(step, tmp_path / "hf")
    assert str(e.value) == ("cannot export as Mixtral: blocks.0.moe.expert_bias is not zero and Mixtral has no place "
                            "for it (the aux-loss-free routing bias of model.moe_bias_update_rate)")
    assert not (tmp_path / "hf").exists()


def test_an_adapter_file_keeps_the_expert_bias(tmp_path: Path) -> None:
    """save_adapter / load_adapter (README, "Adapters") carry the bias a run trained with the LoRA tensors: without
    it the adapter on its base routes otherwise than training did (it was left as the base's, before)."""
    from dist_llm.peft import load_adapter, save_adapter

    trained = _build(tmp_path, **LORA)
    bias = {n: b for n, b in trained.named_buffers() if n.endswith("expert_bias")}
    assert bias
    for b in bias.values():
        b.copy_(torch.linspace(-0.1, 0.1, b.numel()))
    peft = load_config(None, tiny_overrides(tmp_path, **LORA)).peft
    save_adapter(trained, tmp_path / "adapter", peft, {})
    fresh = _build(tmp_path, **LORA)
    load_adapter(fresh, tmp_path / "adapter", peft)
    loaded = dict(fresh.named_buffers())
    for name, b in bias.items():
        assert torch.equal(loaded[name], b), name
