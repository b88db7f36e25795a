"""Hugging Face Mixtral and Qwen2-MoE (`dist_llm.hf_moe`): tiny random models made with transformers give the same
logits through our GPT, whichever layout their experts are stored in, loaded whole, by `model.init_from=hf:` and
through `dist-llm convert`; our MoE models give the same logits through transformers after an export.

Tolerance: fp32 on both sides, the same weights; what differs is the order of the sums (our grouped matmul over
experts' rows and index_add combine against transformers' per-expert loop; Mixtral's weights as a softmax over
the top-k logits against transformers' renormalised top-k of the softmax), rounding at ~1e-7 of logits of order
one: ATOL 1e-5, as the dense Hugging Face tests. A wrong mapping (a transposed or swapped expert, a missing shared
gate) moves logits by 1e-2 or more."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dist_llm.config import ConfigError, ModelConfig, load_config, validate
from dist_llm.convert import convert_checkpoint_to_hf, convert_hf_to_checkpoint, save_hf
from dist_llm.hf import ARCH_KEYS, HFCheckpoint, load_hf, model_config_from_hf, read_hf_tensors
from dist_llm.model import GPT
from dist_llm.safetensors_read import ShardFile
from tests.conftest import tiny_overrides
from tests.test_hf import ATOL, VOCAB, hf_logits, max_diff, our_logits  # (sets transformers offline first)

transformers = pytest.importorskip("transformers")

E, K = 4, 2


def hf_moe(kind: str, **kw: object) -> torch.nn.Module:
    """A tiny random Mixtral or Qwen2-MoE, every weight random (transformers zero-inits biases, sets norms to one
    and may leave a router at zero: randomised, so that every mapping shows in the logits)."""
    common = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": VOCAB, "max_position_embeddings": 32, "bos_token_id": None, "eos_token_id": None,
              "num_experts_per_tok": K, "tie_word_embeddings": False}
    common.update(kw)
    if kind == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            intermediate_size=48, num_local_experts=E, **common))
    else:
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            intermediate_size=64, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=E,
            **common))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or p.std() == 0:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def write_fused(model: torch.nn.Module, path: Path) -> Path:
    """The experts as transformers 5 holds them in memory (gate_up_proj (E, 2H, C), down_proj (E, C, H)): its
    state_dict saved as it is."""
    path.mkdir()
    model.config.to_json_file(path / "config.json")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path / "model.safetensors")
    return path


CASES = {"mixtral": ("mixtral", {}),
         "qwen2_moe": ("qwen2_moe", {}),  # norm_topk_prob false: softmax_topk; every block MoE
         "qwen2_moe-step2-normtopk": ("qwen2_moe", {"num_hidden_layers": 3, "decoder_sparse_step": 2,
                                                    "norm_topk_prob": True, "qkv_bias": False})}


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("layout", ["per_expert", "sharded", "fused"])
@pytest.mark.parametrize("case", list(CASES))
def test_load_hf_moe_logits_match(case: str, layout: str, tmp_path: Path, tokens: torch.Tensor) -> None:
    kind, kw = CASES[case]
    torch.manual_seed(1)
    hf = hf_moe(kind, **kw)
    path = tmp_path / "hf"
    if layout == "fused":
        write_fused(hf, path)
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in read_hf_tensors(path))
    else:  # transformers 5 saves per expert (the Hub layout)
        hf.save_pretrained(path, max_shard_size="40KB" if layout == "sharded" else "5GB")
        assert (path / "model.safetensors.index.json").is_file() == (layout == "sharded")
        assert any(".experts.0." in k for k in read_hf_tensors(path))
    ours = load_hf(path)
    c = ours.cfg
    assert (c.n_experts, c.moe_top_k) == (E, K)
    if kind == "qwen2_moe":
        assert (c.n_shared_experts, c.moe_shared_hidden, c.moe_shared_gate) == (1, 40, True)
        assert (c.bias, c.qkv_bias) == (False, kw.get("qkv_bias", True))  # q/k/v biases alone
        assert c.moe_router_order == ("topk_softmax" if kw.get("norm_topk_prob") else "softmax_topk")
        assert [c.is_moe_block(i) for i in range(c.n_layer)] == [hf.model.layers[i].mlp.__class__.__name__ ==
                                                                 "Qwen2MoeSparseMoeBlock" for i in range(c.n_layer)]
    diff = max_diff(our_logits(ours, tokens), hf_logits(hf, tokens))
    print(f"{case} {layout}: max |logit diff| = {diff:.2e}")
    assert diff < ATOL


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_reads_only_the_experts_asked_for(layout: str, tmp_path: Path) -> None:
    """A rank that keeps experts [1, 3) reads those experts' bytes alone (per expert: their own tensors only)."""
    torch.manual_seed(2)
    hf = hf_moe("mixtral")
    path = tmp_path / "hf"
    write_fused(hf, path) if layout == "fused" else hf.save_pretrained(path)
    cfg = model_config_from_hf(path)
    whole = load_hf(path).blocks[1].moe.experts.w_up.detach()  # (E, C, H)
    read: dict[str, int] = {}
    real = ShardFile.blocks

    def blocks(self: ShardFile, key: str, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        for at, t in real(self, key, *args, **kwargs):  # type: ignore[arg-type]
            read[key] = read.get(key, 0) + t.numel()
            yield at, t

    ShardFile.blocks = blocks  # type: ignore[method-assign]
    try:
        with HFCheckpoint(path, cfg) as src:
            part = src.read("blocks.1.moe.experts.w_up", rows=[(1, 3)])
    finally:
        ShardFile.blocks = real  # type: ignore[method-assign]
    assert torch.equal(part, whole[1:3])
    C, H = cfg.n_embd, cfg.moe_expert_hidden
    if layout == "fused":
        assert read == {"model.layers.1.mlp.experts.gate_up_proj": 2 * H * C}  # the up half of experts 1, 2
    else:
        assert read == {f"model.layers.1.block_sparse_moe.experts.{e}.w3.weight": H * C for e in (1, 2)}


def test_init_from_hf_moe(tmp_path: Path, tokens: torch.Tensor) -> None:
    """`model.init_from=hf:` of a Qwen2-MoE: the architecture from config.json (validated: MoE with hf: is no
    longer refused), the weights read into the model the trainer builds; after a training step (every weight
    moved, q/k/v biases too) it exports to a Qwen2-MoE with its logits."""
    from dist_llm.parallel.context import ParallelContext
    from dist_llm.train.init_from import resolve_architecture
    from dist_llm.train.trainer import build_model

    torch.manual_seed(3)
    hf = hf_moe("qwen2_moe")
    hf.save_pretrained(tmp_path / "hf")
    overrides = tiny_overrides(tmp_path / "run", model__init_from=f"hf:{tmp_path / 'hf'}", train__device="cpu",
                               train__compile="false")
    cfg = resolve_architecture(load_config(None, overrides))
    validate(cfg)
    assert (cfg.model.n_experts, cfg.model.moe_shared_gate, cfg.model.moe_router_order) == (E, True, "softmax_topk")
    model = build_model(cfg, ParallelContext.from_config(cfg))
    assert max_diff(our_logits(model, tokens), hf_logits(hf, tokens)) < ATOL
    model.train()
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad.sign()
    save_hf(model, tmp_path / "tuned")
    tuned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tuned").eval()
    assert max_diff(hf_logits(tuned, tokens), our_logits(model, tokens)) < ATOL


MOE_MODELS = {
    "mixtral": {"bias": False, "n_kv_head": 2, "tie_embeddings": True},
    "qwen2_moe": {"bias": True, "n_shared_experts": 1, "moe_shared_hidden": 40, "moe_shared_gate": True,
                  "moe_router_order": "softmax_topk", "moe_every": 2, "n_layer": 3},
    # two shared experts are one MLP twice as wide: Qwen2-MoE's one shared expert of that width
    "qwen2_moe-2shared": {"bias": False, "qkv_bias": True, "n_shared_experts": 2, "moe_shared_gate": True},
}


def our_moe(name: str, **kw: object) -> GPT:
    keys = {"n_layer": 2, "n_head": 4, "n_embd": 32, "vocab_size": VOCAB, "block_size": 32, "pos_emb": "rope",
            "norm": "rmsnorm", "mlp": "swiglu", "tie_embeddings": False, "n_experts": E, "moe_top_k": K,
            "moe_hidden": 24, **MOE_MODELS[name], **kw}
    cfg = ModelConfig(**keys)  # type: ignore[arg-type]
    torch.manual_seed(4)
    model = GPT(cfg).eval()
    with torch.no_grad():  # biases start at zero: the q/k/v ones made random, so their mapping shows
        for block in model.blocks:
            if block.attn.qkv.bias is not None:
                block.attn.qkv.bias.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("name", list(MOE_MODELS))
def test_save_hf_moe_loads_in_transformers(name: str, tmp_path: Path, tokens: torch.Tensor) -> None:
    ours = our_moe(name)
    save_hf(ours, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == name.split("-")[0]
    names = read_hf_tensors(tmp_path / "out")
    assert not any("gate_up_proj" in k for k in names)  # per expert, the Hub layout
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    classes = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
    assert type(back).__name__ == classes[config["model_type"]]
    assert max_diff(hf_logits(back, tokens), our_logits(ours, tokens)) < ATOL
    again = load_hf(tmp_path / "out", ModelConfig(init_std=ours.cfg.init_std))  # and back: the same model
    changed = {"qwen2_moe-2shared": {"n_shared_experts": 1, "moe_shared_hidden": 2 * 24},
               "qwen2_moe": {"bias": False, "qkv_bias": True}}.get(name, {})  # (zero biases come back as none)
    assert {key: getattr(again.cfg, key) for key in ARCH_KEYS} == {**{key: getattr(ours.cfg, key) for key in ARCH_KEYS},
                                                                  **changed}
    mine = ours.state_dict()
    for k, v in again.state_dict().items():
        assert torch.equal(v[:VOCAB], mine[k][:VOCAB]), k


@pytest.mark.parametrize("overrides, says", [
    ({"n_shared_experts": 1}, "Qwen2-MoE needs model.moe_shared_gate=true"),
    ({"bias": True}, "Mixtral needs model.bias=false"),
    ({"moe_router_order": "softmax_topk"}, "Mixtral needs model.moe_router_order=topk_softmax"),
    ({"pos_emb": "learned"}, "model.pos_emb=rope"),
])
def test_save_hf_moe_refuses_what_has_no_hf_equivalent(overrides: dict, says: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=says) as e:
        save_hf(our_moe("mixtral", **overrides), tmp_path / "out")
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


@pytest.mark.parametrize("tensor", ["blocks.0.attn.proj.bias", "blocks.1.moe.experts.b_up", "blocks.1.moe.expert_bias"])
def test_save_hf_moe_refuses_weights_the_format_drops(tensor: str, tmp_path: Path) -> None:
    """Qwen2-MoE has biases on q/k/v only and neither family a routing bias: an export is exact only while the
    tensors it leaves out are zero, so a non-zero one is named and nothing is written."""
    ours = our_moe("qwen2_moe")
    with torch.no_grad():
        dict(ours.named_parameters(), **dict(ours.named_buffers()))[tensor].fill_(0.5)
    with pytest.raises(ConfigError, match=f"cannot export as Qwen2-MoE: {tensor.replace('.', '[.]')} is not zero"):
        save_hf(ours, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_qkv_bias_alone_exports_as_llama(tmp_path: Path, tokens: torch.Tensor) -> None:
    """A dense model with model.qkv_bias alone: Llama's attention_bias, o_proj's bias written as zeros."""
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, block_size=32, pos_emb="rope", norm="rmsnorm",
                      mlp="swiglu", bias=False, qkv_bias=True)
    ours = GPT(cfg).eval()
    with torch.no_grad():
        for block in ours.blocks:
            block.attn.qkv.bias.normal_(0, 0.1)
    save_hf(ours, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert back.config.attention_bias and not back.config.mlp_bias
    assert max_diff(hf_logits(back, tokens), our_logits(ours, tokens)) < ATOL


def test_convert_moe_round_trip(tmp_path: Path, tokens: torch.Tensor) -> None:
    """`convert --from-hf` of a sharded Mixtral, then `--to-hf`: transformers' logits, the same tensors; the
    checkpoint between loads as `dist-llm sample` loads it, with the same logits."""
    torch.manual_seed(5)
    hf = hf_moe("mixtral")
    ref = hf_logits(hf, tokens)
    hf.save_pretrained(tmp_path / "src", max_shard_size="40KB")
    # (in process: the command line around these is the dense tests' test_convert_round_trip)
    convert_hf_to_checkpoint(tmp_path / "src", tmp_path / "ckpt")
    convert_checkpoint_to_hf(tmp_path / "ckpt", tmp_path / "back")
    from dist_llm.sample import load_model

    model, _ = load_model(tmp_path / "ckpt", torch.device("cpu"))
    assert max_diff(our_logits(model, tokens), ref) < ATOL
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert max_diff(hf_logits(back, tokens), ref) < ATOL
    a, b = read_hf_tensors(tmp_path / "src"), read_hf_tensors(tmp_path / "back")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _hf_dir(tmp_path: Path, **changes: object) -> Path:
    path = tmp_path / "hf"
    if not path.exists():
        hf_moe("qwen2_moe").save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))
    return path


@pytest.mark.parametrize("changes, says", [
    ({"model_type": "qwen3_moe"}, "model_type 'qwen3_moe' is not supported"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers [0] is not supported"),
    ({"num_experts_per_tok": 9}, "4 experts with num_experts_per_tok 9"),
])
def test_unsupported_moe_configs_are_named(changes: dict, says: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=says.replace("[", "\\[").replace("]", "\\]")) as e:
        model_config_from_hf(_hf_dir(tmp_path, **changes))
    assert "config.json" in str(e.value) and "\n" not in str(e.value)


def test_dense_import_resets_moe_keys_of_base(tmp_path: Path) -> None:
    """A dense Hugging Face model is dense whatever the base config's MoE keys said."""
    from tests.test_hf import hf_llama, save

    path = save(hf_llama(), tmp_path / "llama")
    cfg = model_config_from_hf(path, ModelConfig(n_experts=8, n_shared_experts=1, moe_shared_gate=True))
    assert (cfg.n_experts, cfg.n_shared_experts, cfg.moe_shared_gate) == (0, 0, False)


def test_shared_keys_checked_and_fingerprint_kept(tmp_path: Path) -> None:
    def config(**model: object):  # noqa: ANN202
        return load_config(None, tiny_overrides(tmp_path, **{f"model__{k}": v for k, v in model.items()}))

    for key, value in (("moe_shared_gate", "true"), ("moe_shared_hidden", 16)):
        with pytest.raises(ConfigError, match=f"model.{key}: set, but there is no shared expert"):
            validate(config(n_experts=4, **{key: value}))
    # a model without the new keys (MoE or dense) keeps the fingerprint it had before they existed
    cfg = config(n_experts=4, n_shared_experts=1)
    old = {k: v for k, v in dataclasses.asdict(cfg.model).items()
           if k not in ("init_from", "qkv_bias", "moe_shared_hidden", "moe_shared_gate")}
    assert cfg.fingerprint() == hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:16]
    assert config(n_experts=4, n_shared_experts=1, moe_shared_gate="true").fingerprint() != cfg.fingerprint()
    dense = config()
    old = {k: v for k, v in dataclasses.asdict(dense.model).items()
           if k not in ("init_from", "qkv_bias") and k != "n_experts" and not k.startswith(("moe_", "n_shared_"))}
    assert dense.fingerprint() == hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:16]
    assert config(qkv_bias="true").fingerprint() != dense.fingerprint()
