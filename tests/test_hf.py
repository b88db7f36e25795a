"""Hugging Face interchange (`dist_llm.hf`, `dist-llm convert`): tiny random GPT-2 and Llama-family models
built with transformers give the same logits through our GPT, and our models the same through transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file

from dist_llm.config import ConfigError, ModelConfig
from dist_llm.convert import save_hf
from dist_llm.hf import ARCH_KEYS, load_hf, load_hf_state_dict, model_config_from_hf, read_hf_tensors
from dist_llm.model import GPT
from tests.conftest import REPO

VOCAB = 300  # not a multiple of 128: the embedding and head are padded to 384
ATOL = 1e-5


def hf_gpt2(**kw: object) -> torch.nn.Module:
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32,
                                  bos_token_id=None, eos_token_id=None, **kw)
    return transformers.GPT2LMHeadModel(cfg).eval()


def hf_llama(kind: str = "llama", **kw: object) -> torch.nn.Module:
    common = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "vocab_size": VOCAB, "intermediate_size": 96, "max_position_embeddings": 32, "bos_token_id": None,
                  "eos_token_id": None}
    common.update(kw)
    if kind == "llama":
        common.setdefault("tie_word_embeddings", False)
        common.setdefault("rms_norm_eps", 1e-5)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(rope_theta=5000.0, **common))
    elif kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=16, **common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(tie_word_embeddings=True, **common))
    with torch.no_grad():  # HF zero-inits biases and sets norms to one: randomise them so the mapping shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def save(model: torch.nn.Module, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))


def hf_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits.float()


def our_logits(model: GPT, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(tokens).float()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


# -- Hugging Face -> ours ------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral", "qwen2"])
def test_load_hf_logits_match(family: str, tmp_path: Path, tokens: torch.Tensor) -> None:
    torch.manual_seed(1)
    hf = hf_gpt2() if family == "gpt2" else hf_llama(family)
    ours = load_hf(save(hf, tmp_path / family))
    if family == "mistral":
        tokens = tokens[:, :16]  # its sliding window: the context is capped there
    diff = max_diff(our_logits(ours, tokens), hf_logits(hf, tokens))
    print(f"{family}: max |logit diff| = {diff:.2e}")
    assert diff < ATOL
    cfg = ours.cfg
    assert cfg.vocab_size == VOCAB and cfg.padded_vocab == 384
    assert torch.count_nonzero(ours.wte.weight[VOCAB:]) == 0 and torch.count_nonzero(ours.lm_head.weight[VOCAB:]) == 0
    if family == "gpt2":
        assert (cfg.pos_emb, cfg.norm, cfg.mlp, cfg.bias, cfg.tie_embeddings) == ("learned", "layernorm", "gelu", True, True)
        assert ours.lm_head.weight is ours.wte.weight
    else:
        assert (cfg.pos_emb, cfg.norm, cfg.mlp, cfg.n_kv_head) == ("rope", "rmsnorm", "swiglu", 2)
        assert cfg.mlp_hidden == 96
    if family == "llama":
        assert cfg.rope_theta == 5000.0 and cfg.norm_eps == 1e-5 and not cfg.tie_embeddings and not cfg.bias
        assert ours.lm_head.weight is not ours.wte.weight
    if family == "mistral":
        assert cfg.block_size == 16  # capped at the sliding window, inside which it is plain causal attention
    if family == "qwen2":
        assert cfg.bias and cfg.tie_embeddings
        assert torch.count_nonzero(ours.blocks[0].attn.proj.bias) == 0  # qwen2 has q/k/v biases only


def test_pytorch_model_bin_and_sharded_safetensors(tmp_path: Path, tokens: torch.Tensor) -> None:
    torch.manual_seed(2)
    hf = hf_llama()
    ref = hf_logits(hf, tokens)
    # transformers 5 always writes safetensors, so the .bin layout (as older releases wrote it) is made by hand
    binary = tmp_path / "bin"
    hf.config.save_pretrained(binary)
    torch.save(hf.state_dict(), binary / "pytorch_model.bin")
    assert max_diff(our_logits(load_hf(binary), tokens), ref) < ATOL
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="60KB")
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()
    assert max_diff(our_logits(load_hf(sharded), tokens), ref) < ATOL


def test_model_config_from_hf_keeps_the_other_keys_of_base(tmp_path: Path) -> None:
    path = save(hf_gpt2(), tmp_path / "g")
    cfg = model_config_from_hf(path, ModelConfig(pad_vocab_to=64, dropout=0.1, init_std=0.01, n_layer=9))
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.block_size, cfg.vocab_size) == (2, 64, 4, 32, VOCAB)
    assert (cfg.pad_vocab_to, cfg.padded_vocab, cfg.dropout, cfg.init_std) == (64, 320, 0.1, 0.01)
    sd = load_hf_state_dict(path, cfg)
    assert sd["wte.weight"].shape == (320, 64) and sd["blocks.0.attn.qkv.weight"].shape == (192, 64)


# -- ours -> Hugging Face ------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides", [
    {"pos_emb": "learned", "norm": "layernorm", "mlp": "gelu", "bias": True, "tie_embeddings": True},
    {"pos_emb": "learned", "norm": "layernorm", "mlp": "gelu", "bias": False, "tie_embeddings": False, "mlp_hidden": 80},
    {"pos_emb": "rope", "norm": "rmsnorm", "mlp": "swiglu", "n_kv_head": 2, "bias": False, "tie_embeddings": False, "rope_theta": 500.0},
    {"pos_emb": "rope", "norm": "rmsnorm", "mlp": "swiglu", "n_kv_head": 1, "bias": True, "tie_embeddings": True},
], ids=["gpt2-tied", "gpt2-nobias-untied", "llama-gqa-untied", "llama-mqa-bias-tied"])
def test_save_hf_loads_in_transformers(overrides: dict, tmp_path: Path, tokens: torch.Tensor) -> None:
    torch.manual_seed(3)
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB, block_size=32, norm_eps=1e-5, **overrides)
    ours = GPT(cfg).eval()
    with torch.no_grad():  # norms start at one and biases at zero: randomise them so the mapping shows
        for name, p in ours.named_parameters():
            if "ln_" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    save_hf(ours, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.model_type == ("gpt2" if cfg.pos_emb == "learned" else "llama")
    assert hf.config.vocab_size == VOCAB
    diff = max_diff(our_logits(ours, tokens), hf_logits(hf, tokens))
    print(f"{'-'.join(f'{k}={v}' for k, v in overrides.items())}: max |logit diff| = {diff:.2e}")
    assert diff < ATOL
    # and back: the same architecture and the very same weights (a bias-free GPT-2 comes back with zero biases)
    again = load_hf(tmp_path / "hf", ModelConfig(init_std=cfg.init_std))
    for key in ARCH_KEYS:
        assert getattr(again.cfg, key) == (True if key == "bias" and cfg.pos_emb == "learned" else getattr(cfg, key)), key
    mine, theirs = ours.state_dict(), again.state_dict()
    for name, t in theirs.items():
        if name in ("wte.weight", "lm_head.weight"):  # the vocabulary padding is not exported; it comes back zero
            assert torch.equal(mine[name][:VOCAB], t[:VOCAB]) and torch.count_nonzero(t[VOCAB:]) == 0, name
        else:
            assert torch.equal(mine[name], t) if name in mine else torch.count_nonzero(t) == 0, name


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_hf_ours_hf_round_trip_is_identical(family: str, tmp_path: Path) -> None:
    torch.manual_seed(4)
    hf = hf_gpt2() if family == "gpt2" else hf_llama(family)
    src = save(hf, tmp_path / "src")
    save_hf(load_hf(src), tmp_path / "dst")
    a, b = read_hf_tensors(src), load_file(str(tmp_path / "dst" / "model.safetensors"))
    if family == "qwen2":  # our export writes the zero o_proj/mlp biases qwen2 leaves out (as llama with biases)
        b = {k: v for k, v in b.items() if k in a or torch.count_nonzero(v)}
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("overrides, key", [
    ({"pos_emb": "alibi"}, "model.pos_emb=alibi"),
    ({"pos_emb": "learned", "norm": "rmsnorm"}, "model.norm=rmsnorm"),
    ({"pos_emb": "learned", "n_kv_head": 2}, "model.n_kv_head=2"),
    ({"pos_emb": "rope", "norm": "layernorm", "mlp": "swiglu"}, "model.norm=layernorm"),
    ({"pos_emb": "rope", "norm": "rmsnorm", "mlp": "gelu"}, "model.mlp=gelu"),
])
def test_save_hf_refuses_what_has_no_hf_equivalent(overrides: dict, key: str, tmp_path: Path) -> None:
    model = GPT(ModelConfig(n_layer=1, n_head=4, n_embd=32, **overrides))
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        save_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_load_hf_errors_name_the_file_and_key(tmp_path: Path) -> None:
    def write(name: str, config: dict) -> Path:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        return tmp_path / name

    with pytest.raises(ConfigError, match="not found"):
        load_hf(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="config.json: not found"):
        load_hf(tmp_path / "empty")
    with pytest.raises(ConfigError, match="model_type 'bert' is not supported"):
        load_hf(write("bert", {"model_type": "bert"}))
    llama = hf_llama().config.to_dict()
    with pytest.raises(ConfigError, match="rope_parameters.rope_type 'llama3'"):
        load_hf(write("scaled", {**llama, "rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}))
    with pytest.raises(ConfigError, match="no weights found"):
        load_hf(write("noweights", llama))
    with pytest.raises(ConfigError, match="activation_function 'relu'"):
        load_hf(write("relu", {**hf_gpt2().config.to_dict(), "activation_function": "relu"}))
    path = save(hf_gpt2(), tmp_path / "extra")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["transformer.h.0.attn.q_norm.weight"] = torch.ones(4)
    from safetensors.torch import save_file

    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="unexpected tensor 'h.0.attn.q_norm.weight'"):
        load_hf(path)


# -- dist-llm convert ----------------------------------------------------------------------------------------
def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "dist_llm.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=env, check=False)


def run(*args: str) -> subprocess.CompletedProcess:
    return cli("convert", *args)


def _without(config: dict, *keys: str) -> dict:
    return {k: v for k, v in config.items() if k not in keys}


GPT2_CONFIG = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": VOCAB, "n_positions": 32}
LLAMA_CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                "num_key_value_heads": 2, "vocab_size": VOCAB, "intermediate_size": 96, "max_position_embeddings": 32,
                "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}}


@pytest.mark.parametrize("config, says", [
    ({**LLAMA_CONFIG, "rms_norm_eps": "x"}, 'rms_norm_eps must be a positive number, got "x"'),
    ({**LLAMA_CONFIG, "hidden_size": [64]}, "hidden_size must be a positive integer, got [64]"),
    ({**LLAMA_CONFIG, "num_hidden_layers": 2.5}, "num_hidden_layers must be a positive integer, got 2.5"),
    ({**LLAMA_CONFIG, "num_attention_heads": True}, "num_attention_heads must be a positive integer, got true"),
    ({**LLAMA_CONFIG, "num_key_value_heads": -2}, "num_key_value_heads must be a positive integer, got -2"),
    ({**LLAMA_CONFIG, "head_dim": "16"}, 'head_dim must be a positive integer, got "16"'),
    ({**LLAMA_CONFIG, "model_type": "mistral", "sliding_window": "x"},
     'sliding_window must be an integer >= 0, got "x"'),
    ({**LLAMA_CONFIG, "rope_parameters": {"rope_type": "default", "rope_theta": "abc"}},
     'rope_parameters.rope_theta must be a positive number, got "abc"'),
    ({**_without(LLAMA_CONFIG, "rope_parameters"), "rope_theta": "abc"}, 'rope_theta must be a positive number, got "abc"'),
    ({**LLAMA_CONFIG, "tie_word_embeddings": "false"}, 'tie_word_embeddings must be true or false, got "false"'),
    ({**LLAMA_CONFIG, "model_type": "mixtral", "num_local_experts": "4", "num_experts_per_tok": 2},
     'num_local_experts must be a positive integer, got "4"'),
    ({**GPT2_CONFIG, "n_embd": 64.0}, "n_embd must be a positive integer, got 64.0"),
    ({**GPT2_CONFIG, "layer_norm_epsilon": True}, "layer_norm_epsilon must be a positive number, got true"),
    ({**GPT2_CONFIG, "scale_attn_weights": "no"}, 'scale_attn_weights must be true or false, got "no"'),
], ids=["eps-string", "hidden-list", "layers-float", "heads-true", "kv-negative", "head-dim-string",
        "window-string", "rope-parameters-string", "rope-theta-string", "tie-string", "experts-string",
        "gpt2-width-float", "gpt2-eps-true", "gpt2-flag-string"])
def test_config_json_values_of_the_wrong_type_are_one_line(config: dict, says: str, tmp_path: Path) -> None:
    """int() and float() took 64.9 as 64 and true as 1, and turned "x" or [64] into a traceback: each key is read
    as the type it is, one line naming the file and the key."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as e:
        model_config_from_hf(tmp_path)
    assert str(e.value) == f"{tmp_path / 'config.json'}: {says}"


def test_config_json_of_the_wrong_type_through_convert_and_init_from(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                     corpus_file: Path) -> None:
    """As a user meets it: `convert --from-hf` and `train model.init_from=hf:` exit 2 with one line (before: a
    traceback from int() or float())."""
    from dist_llm.cli import main

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**LLAMA_CONFIG, "rms_norm_eps": "x"}))
    line = f'dist-llm: error: {tmp_path / "hf" / "config.json"}: rms_norm_eps must be a positive number, got "x"'
    capsys.readouterr()
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines() == [line]
    assert main(["train", f"model.init_from=hf:{tmp_path / 'hf'}", f"data.source={corpus_file}",
                 f"train.out_dir={tmp_path / 'run'}", "train.max_steps=1", "train.device=cpu"]) == 2
    assert [e for e in capsys.readouterr().err.splitlines() if e.startswith("dist-llm: error:")] == [line]
    assert not (tmp_path / "out").exists()


def test_convert_round_trip(tmp_path: Path, tokens: torch.Tensor) -> None:
    from dist_llm.parallel.context import ParallelContext
    from dist_llm.parallel.data.base import DataParallel
    from dist_llm.sample import load_model
    from dist_llm.train import checkpoint as ckpt

    torch.manual_seed(5)
    hf = hf_llama()
    ref = hf_logits(hf, tokens)
    src = save(hf, tmp_path / "src")
    from dist_llm.data.tokenizer import BPETokenizer

    BPETokenizer.train(["def f(x):\n    return x + 1\n" * 20], VOCAB).save(src)  # travels with the weights
    proc = run("--from-hf", str(src), "--out", str(tmp_path / "ckpt"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ckpt.is_complete(tmp_path / "ckpt") and (tmp_path / "ckpt" / "tokenizer.json").is_file()
    sample = cli("sample", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "def ", "--max-new-tokens", "8",
                 "--device", "cpu")
    assert sample.returncode == 0 and sample.stdout.startswith("def "), sample.stderr[-2000:]
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert manifest["step"] == 0 and manifest["layout"]["world_size"] == 1

    model, _ = load_model(tmp_path / "ckpt", torch.device("cpu"))  # what `dist-llm sample` does
    assert max_diff(our_logits(model, tokens), ref) < ATOL
    # what `train.resume` does: a fresh model and optimizer filled from the checkpoint
    import yaml

    from dist_llm.config import config_from_dict

    cfg = config_from_dict(yaml.safe_load((tmp_path / "ckpt" / "config.yaml").read_text()), check=False)
    assert manifest["model_fingerprint"] == cfg.fingerprint()
    cfg.train.device = "cpu"
    fresh = GPT(cfg.model)
    dp = DataParallel(fresh, cfg, ParallelContext.from_config(cfg))
    buffers = dp.checkpoint_state()
    state = ckpt.load_checkpoint(tmp_path / "ckpt", state=buffers, ctx=dp.ctx)
    dp.load_checkpoint_state(buffers)
    assert state["step"] == 0 and max_diff(our_logits(fresh, tokens), ref) < ATOL

    proc = run("--to-hf", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    diff = max_diff(hf_logits(back, tokens), ref)
    print(f"convert round trip: max |logit diff| = {diff:.2e}")
    assert diff < ATOL
    a, b = read_hf_tensors(src), read_hf_tensors(tmp_path / "back")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


def test_convert_errors_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from dist_llm.cli import main

    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    as_user = {  # through a real process, as a user meets them
        "missing dir": (["--from-hf", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o1")], "not found"),
        "bert": (["--from-hf", str(tmp_path / "bert"), "--out", str(tmp_path / "o2")], "model_type 'bert'"),
    }
    in_process = {  # the same guarded command, without paying for a process each
        "neither": (["--out", str(tmp_path / "o3")], "exactly one of"),
        "both": (["--from-hf", "a", "--to-hf", "b", "--out", str(tmp_path / "o4")], "exactly one of"),
        "no out": (["--from-hf", str(tmp_path / "bert")], "--out"),
        "not a checkpoint": (["--to-hf", str(tmp_path / "bert"), "--out", str(tmp_path / "o5")], "no complete checkpoint"),
        "missing checkpoint": (["--to-hf", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o6")], "not found"),
        "out not empty": (["--from-hf", str(tmp_path / "bert"), "--out", str(tmp_path / "full")], "not an empty directory"),
    }
    for name, (args, message) in {**as_user, **in_process}.items():
        if name in as_user:
            proc = run(*args)
            code, stderr = proc.returncode, proc.stderr
        else:
            code = main(["convert", *args])
            stderr = capsys.readouterr().err
        assert code == 2, (name, stderr)
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("dist-llm: error:") and message in lines[0], (name, stderr)
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 7))
