"""LoRA, adapters and QLoRA: frozen bases, merging, adapter-only checkpoints, and parallel layouts equal to one process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from dist_llm.config import ConfigError, load_config
from dist_llm.model import GPT
from dist_llm.peft import apply_peft, load_adapter, lora_modules, merge, save_adapter, trainable_names, unmerge
from dist_llm.peft.nf4 import NF4Linear
from dist_llm.optim import build_optimizer
from tests.conftest import tiny_overrides
from tests.distributed import run_distributed
from tests.test_data_parallel import STEPS, assert_same_run, corpus, reference, train  # noqa: F401

ALL = "[qkv, attn_out, mlp_up, mlp_down]"
LORA = {"peft__method": "lora", "peft__targets": ALL, "peft__rank": 4, "optim__lr": 1e-2}


def _model(tmp_path: Path, **extra: Any) -> GPT:
    cfg = load_config(None, tiny_overrides(tmp_path, **extra))
    torch.manual_seed(0)
    return GPT(cfg.model), cfg


def _idx() -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_lora_freezes_the_base_and_starts_as_it(tmp_path: Path, mlp: str) -> None:
    model, cfg = _model(tmp_path, model__mlp=mlp, **LORA)
    before = model(_idx())
    apply_peft(model, cfg.peft, seed=0)
    names = trainable_names(model)
    per_block = 4 * 2 + (2 if mlp == "swiglu" else 0)  # A and B on qkv, proj, up, down (and gate)
    assert len(names) == cfg.model.n_layer * per_block and all(".lora." in n for n in names)
    torch.testing.assert_close(model(_idx()), before, rtol=0, atol=0)  # B = 0: the update starts at zero
    model(_idx()).sum().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n not in names)
    assert all(p.grad is not None for n, p in model.named_parameters() if n in names)
    opt = build_optimizer(model, cfg.optim, torch.device("cpu"))
    assert sum(len(g["params"]) for g in opt.param_groups) == len(names)  # no optimizer state for the base


def test_lora_and_adapter_parameter_counts(tmp_path: Path) -> None:
    model, cfg = _model(tmp_path, **LORA)
    apply_peft(model, cfg.peft, seed=0)
    r, d = cfg.peft.rank, cfg.model.n_embd
    shapes = {"attn.qkv": (d, 3 * d), "attn.proj": (d, d), "mlp.up": (d, 4 * d), "mlp.down": (4 * d, d)}
    for name, (d_in, d_out) in shapes.items():  # A (r x d_in) and B (d_out x r): r * (d_in + d_out)
        lora = model.blocks[0].get_submodule(name).lora
        assert lora.A.numel() + lora.B.numel() == r * (d_in + d_out)
    adapted, acfg = _model(tmp_path, peft__method="adapter", peft__rank=8)
    apply_peft(adapted, acfg.peft, seed=0)
    m = acfg.peft.rank
    assert sum(p.numel() for p in adapted.blocks[0].attn.adapter.parameters()) == 2 * m * d + d + m


def test_adapter_only_checkpoint_of_gpt2_124m_is_under_1_percent(tmp_path: Path) -> None:
    with torch.device("meta"):
        model, cfg = _model(tmp_path, model__n_layer=12, model__n_head=12, model__n_embd=768, model__block_size=1024,
                            model__vocab_size=50257, peft__method="lora", peft__rank=8, peft__targets="[qkv]")
        apply_peft(model, cfg.peft, seed=0)
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert 124e6 < total < 125e6 and trained == 12 * 8 * (768 + 3 * 768)
    assert trained / total < 0.01  # a checkpoint holds each trained tensor and its two Adam moments: the same ratio


def test_lora_merge_and_unmerge(tmp_path: Path) -> None:
    model, cfg = _model(tmp_path, **LORA)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    apply_peft(model, cfg.peft, seed=0)
    with torch.no_grad():
        for _, lora in lora_modules(model):
            lora.B.normal_(std=0.1)
    adapted = model(_idx())
    merge(model)
    torch.testing.assert_close(model(_idx()), adapted, rtol=1e-5, atol=1e-5)  # the hook is off when merged
    assert not torch.equal(model.blocks[0].attn.qkv.weight, base["blocks.0.attn.qkv.weight"])
    unmerge(model)
    torch.testing.assert_close(model(_idx()), adapted, rtol=1e-5, atol=1e-5)
    for n, p in base.items():
        torch.testing.assert_close(dict(model.named_parameters())[n], p, rtol=0, atol=1e-6)


def test_adapter_weights_save_and_load_on_a_base(tmp_path: Path) -> None:
    model, cfg = _model(tmp_path, **LORA)
    apply_peft(model, cfg.peft, seed=0)
    with torch.no_grad():
        for _, lora in lora_modules(model):
            lora.B.normal_(std=0.1)
    save_adapter(model, tmp_path / "adapter", cfg.peft, base={"init_from": "", "model_fingerprint": cfg.fingerprint()})
    stored = json.loads((tmp_path / "adapter" / "adapter.json").read_text())
    assert stored["method"] == "lora" and stored["base"]["model_fingerprint"] == cfg.fingerprint()
    fresh, _ = _model(tmp_path)  # the same base weights (seed 0), no adapter yet
    apply_peft(fresh, cfg.peft, seed=5)
    load_adapter(fresh, tmp_path / "adapter", cfg.peft)
    torch.testing.assert_close(fresh(_idx()), model(_idx()), rtol=0, atol=0)
    other, other_cfg = _model(tmp_path, model__mlp="swiglu", **LORA)  # the same settings, one more layer (gate)
    apply_peft(other, other_cfg.peft, seed=0)
    with pytest.raises(ConfigError, match="adapter.safetensors: does not fit this model"):
        load_adapter(other, tmp_path / "adapter", other_cfg.peft)


def _saved_adapter(tmp_path: Path, **extra: Any) -> tuple[Path, dict[str, torch.Tensor]]:
    """An adapter of a LoRA model (B made non-zero) saved at tmp_path/adapter, and its trained tensors."""
    model, cfg = _model(tmp_path, **{**LORA, **extra})
    apply_peft(model, cfg.peft, seed=0)
    with torch.no_grad():
        for _, lora in lora_modules(model):
            lora.B.normal_(std=0.1)
    save_adapter(model, tmp_path / "adapter", cfg.peft, base={})
    return tmp_path / "adapter", {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(("key", "setting", "message"), [
    ("rank", {"peft__rank": 8}, "rank is 4, this model's peft.rank is 8"),
    ("alpha", {"peft__alpha": 4.0}, "alpha is 16.0, this model's peft.alpha is 4.0"),
    ("targets", {"peft__targets": "[qkv]"},
     "targets is ['qkv', 'attn_out', 'mlp_up', 'mlp_down'], this model's peft.targets is ['qkv']"),
    ("method", {"peft__method": "adapter"}, "method is 'lora', this model's peft.method is 'adapter'"),
])
def test_an_adapter_of_other_settings_is_refused_by_key(tmp_path: Path, key: str, setting: dict[str, Any],
                                                        message: str) -> None:
    """adapter.json's settings must be the model's: a rank-4 LoRA copied into a rank-8 one broadcast its A rows and B
    columns (and loaded without a word, before); another alpha scales the update otherwise."""
    path, _ = _saved_adapter(tmp_path)
    model, cfg = _model(tmp_path, **{**LORA, **setting})
    apply_peft(model, cfg.peft, seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ConfigError) as e:
        load_adapter(model, path, cfg.peft)
    assert str(e.value) == f"{path / 'adapter.json'}: {message}"
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # nothing copied


def test_adapter_targets_in_another_order_load(tmp_path: Path) -> None:
    path, trained = _saved_adapter(tmp_path)
    model, cfg = _model(tmp_path, **{**LORA, "peft__targets": "[mlp_down, mlp_up, attn_out, qkv]"})
    apply_peft(model, cfg.peft, seed=0)
    load_adapter(model, path, cfg.peft)
    loaded = dict(model.named_parameters())
    assert all(torch.equal(loaded[n], t) for n, t in trained.items())


@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_an_adapter_tensor_of_another_shape_or_dtype_is_refused(tmp_path: Path, bad: str) -> None:
    """Each tensor is checked against the model's before any is copied: copy_ broadcast a (1, 32) A into a (4, 32)
    one, and cast integers silently."""
    from safetensors.torch import load_file, save_file

    path, _ = _saved_adapter(tmp_path)
    name = "blocks.0.attn.qkv.lora.A"
    tensors = load_file(str(path / "adapter.safetensors"))
    assert tuple(tensors[name].shape) == (4, 32)
    tensors[name] = tensors[name][:1] if bad == "shape" else tensors[name].to(torch.int64)
    save_file(tensors, str(path / "adapter.safetensors"))
    model, cfg = _model(tmp_path, **LORA)
    apply_peft(model, cfg.peft, seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ConfigError) as e:
        load_adapter(model, path, cfg.peft)
    why = "has shape (1, 32), this model's has (4, 32)" if bad == "shape" else "is torch.int64, not a floating-point tensor"
    assert str(e.value) == f"{path / 'adapter.safetensors'}: {name} {why}"
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # nothing copied


def test_adapters_start_as_the_base_and_train_alone(tmp_path: Path) -> None:
    model, cfg = _model(tmp_path, peft__method="adapter", peft__rank=8)
    before = model(_idx())
    apply_peft(model, cfg.peft, seed=0)
    names = trainable_names(model)
    assert names and all(".adapter." in n for n in names)
    assert len(names) == cfg.model.n_layer * 2 * 4  # after attention and MLP: down and up, weight and bias
    torch.testing.assert_close(model(_idx()), before, rtol=0, atol=0)  # up = 0: identity at the start


def test_qlora_stores_the_base_in_4_bits(tmp_path: Path) -> None:
    model, cfg = _model(tmp_path, model__n_embd=64, peft__method="qlora", peft__targets=ALL)
    before = model(_idx())
    linear_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if n.startswith("blocks.")
                       and n.endswith("weight") and p.dim() == 2)
    apply_peft(model, cfg.peft, seed=0)
    quantised = [m for m in model.modules() if isinstance(m, NF4Linear)]
    assert len(quantised) == cfg.model.n_layer * 4
    nf4_bytes = sum(m.nf4_weight().nbytes for m in quantised)
    assert nf4_bytes < linear_bytes / 7  # ~0.52 bytes a weight against 4
    after = model(_idx())
    assert (after - before).abs().mean() < 0.1 * before.abs().mean()  # quantisation error, not a new model
    assert all(".lora." in n for n in trainable_names(model))


def test_peft_checkpoint_holds_only_the_trained_tensors_and_resumes(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                                    corpus: Path) -> None:  # noqa: F811
    run = tmp_path / "run"
    first = train(0, 1, run, corpus, {**LORA, "train__stop_after_step": 4, "train__ckpt_interval": 4})
    keys = FileSystemReader(str(run / "checkpoints" / "step_000004")).read_metadata().state_dict_metadata
    assert {k.split(".", 1)[0] for k in keys} == {"model", "optim"}
    assert all(".lora." in k for k in keys), sorted(k for k in keys if ".lora." not in k)[:3]
    manifest = json.loads((run / "checkpoints" / "step_000004" / "manifest.json").read_text())
    assert manifest["peft_base"]["init_from"] == ""
    lora_bytes = 4 * sum(p.numel() for n, p in first["params"].items() if ".lora." in n)
    assert first["state_bytes"]["grads"] == lora_bytes  # gradients for LoRA only
    assert 2 * lora_bytes <= first["state_bytes"]["optimizer"] < 2 * lora_bytes + 1024  # two moments (+ steps)
    # other LoRA settings are another model: refused in one line before anything is loaded (a review found alpha
    # and targets resumed silently, and a method or rank change failing deep in DCP's load)
    refused = {"alpha": ({"peft__alpha": 64.0}, "peft.alpha=16.0, this run sets peft.alpha=64.0"),
               "targets": ({"peft__targets": "[qkv]"}, r"peft.targets=\['qkv', 'attn_out', 'mlp_up', 'mlp_down'\], "
                           r"this run sets peft.targets=\['qkv'\]"),
               "rank": ({"peft__rank": 8}, "peft.rank=4, this run sets peft.rank=8"),
               "method": ({"peft__method": "none"}, "peft.method=lora, this run sets peft.method=none")}
    for change, message in refused.values():
        with pytest.raises(ConfigError, match=f"step_000004 was trained with {message}"):
            train(0, 1, run, corpus, {**LORA, **change})
    resumed = train(0, 1, run, corpus, {**LORA, "peft__targets": "[mlp_down, mlp_up, attn_out, qkv]"})  # (order)
    ref = reference(tmp_path_factory, corpus, **LORA)
    assert resumed["losses"] == ref["losses"]  # the same run, bit for bit, across the restart


@pytest.mark.parametrize("layout", [
    {"parallel__tp": 2},
    {"parallel__tp": 2, "parallel__sequence_parallel": True},
    {"parallel__dp": 2, "parallel__zero_stage": 3, "train__micro_batch_size": 2},
    {"parallel__pp": 2, "model__n_layer": 4, "train__micro_batch_size": 2},
    {"parallel__dp": 2, "parallel__zero_stage": 0, "train__micro_batch_size": 2,
     "train__activation_checkpointing": "full"},
    {"parallel__dp": 2, "parallel__zero_stage": 1, "train__micro_batch_size": 2},
    {"parallel__dp": 2, "parallel__zero_stage": 2, "train__micro_batch_size": 2,
     "train__activation_checkpointing": "selective"},
], ids=["tp2", "tp2-sp", "zero3", "pp2", "ddp-ckpt", "zero1", "zero2-selective"])
def test_lora_layouts_match_one_process(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path,  # noqa: F811
                                        layout: dict[str, Any]) -> None:
    model = {k: v for k, v in layout.items() if k.startswith("model__")}
    results = run_distributed(train, 2, tmp_path, corpus, {**LORA, **layout}, init_group=False)
    ref = reference(tmp_path_factory, corpus, **LORA, **model)
    got = results[0]
    if "parallel__pp" in layout:  # each stage holds its own blocks
        got = {**got, "params": {k: v for r in results for k, v in r["params"].items()}}
    assert_same_run(got, ref, rtol=1e-5)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_adapters_tensor_parallel_match_one_process(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                    corpus: Path, sequence_parallel: bool) -> None:  # noqa: F811
    extra = {"peft__method": "adapter", "peft__rank": 8, "optim__lr": 1e-2}
    results = run_distributed(train, 2, tmp_path, corpus, {**extra, "parallel__tp": 2,
                                                           "parallel__sequence_parallel": sequence_parallel},
                              init_group=False)
    assert_same_run(results[0], reference(tmp_path_factory, corpus, **extra), rtol=1e-5)


def test_qlora_trains(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    got = train(0, 1, tmp_path, corpus, {"peft__method": "qlora", "peft__targets": ALL, "optim__lr": 1e-2,
                                         "model__n_embd": 64})
    assert got["losses"][-1] < got["losses"][0] - 0.1


def test_lora_leaves_the_base_bit_identical(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    from dist_llm.parallel.context import ParallelContext
    from dist_llm.train.trainer import build_model

    cfg = load_config(None, tiny_overrides(tmp_path / "base", data__source=str(corpus), model__bias=False))
    base = dict(build_model(cfg, ParallelContext.from_config(cfg)).named_parameters())  # the seeded start
    tuned = train(0, 1, tmp_path / "tuned", corpus, LORA)  # eight LoRA steps
    assert tuned["losses"][-1] < tuned["losses"][0]
    for name, p in base.items():
        assert torch.equal(tuned["params"][name], p), name


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_lora_mixed_precision_stays_near_fp32(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path,  # noqa: F811
                                              precision: str) -> None:
    results = run_distributed(train, 2, tmp_path, corpus, {**LORA, "parallel__dp": 2, "parallel__zero_stage": 2,
                                                           "train__micro_batch_size": 2, "train__precision": precision},
                                  init_group=False)
    ref = reference(tmp_path_factory, corpus, **LORA)
    for a, b in zip(results[0]["losses"], ref["losses"], strict=True):
        assert a == pytest.approx(b, rel=2e-2)


def test_peft_bad_values_exit_cleanly(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^peft.rank: must be positive, got 0$"):
        load_config(None, tiny_overrides(tmp_path, peft__method="lora", peft__rank=0))
    with pytest.raises(ConfigError, match=r"^peft.method: qlora is not supported with parallel.tp>1"):
        load_config(None, tiny_overrides(tmp_path, peft__method="qlora", parallel__tp=2))
    with pytest.raises(ConfigError, match=r"^model.init_from: expected hf:DIR or ckpt:DIR, got 'somewhere'$"):
        load_config(None, tiny_overrides(tmp_path, model__init_from="somewhere"))
    with pytest.raises(ConfigError, match=r"^model.init_from: directory not found: /no/such$"):
        load_config(None, tiny_overrides(tmp_path, model__init_from="hf:/no/such"))
