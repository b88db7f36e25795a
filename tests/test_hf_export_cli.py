"""Issue 18, items 7 and 8: the default config's run exports through `dist-llm convert --to-hf` to a folder that
transformers' AutoModelForCausalLM and AutoTokenizer load, the logits and greedy text those give are ours,
and the exported tokenizer encodes and decodes exactly as the run's (byte-level, or BPE) did."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sysconfig
from pathlib import Path

import pytest
import torch
import yaml

from dist_llm.cli import main
from dist_llm.data.tokenizer import BPETokenizer, ByteTokenizer
from dist_llm.hf_tokenizer import write_hf_tokenizer
from dist_llm.train.checksums import sha256_file
from tests.conftest import REPO

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# configs/tiny.yaml as it is (its architecture) with sizes and steps cut so the run takes seconds
SMALL = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "train.micro_batch_size=4",
         "train.global_batch_size=4", "train.max_steps=3", "train.log_interval=1", "train.eval_interval=0",
         "train.ckpt_interval=0", "optim.warmup_steps=1"]


def corpus_sample() -> str:
    """Python source from the standard library, and text no source file has: accents, CJK, emoji, tabs, CRLF."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "\n".join((stdlib / name).read_text() for name in ("textwrap.py", "string.py", "json/decoder.py"))
    return text + "\n# café 日本語 😀 ½ \t\r\n  \u00a0 ∑ x²\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("export")
    corpus = root / "corpus.txt"
    corpus.write_text(corpus_sample())
    out, hf = root / "run", root / "hf"
    # the CLI's own entry point, in this process (a fresh interpreter would cost seconds of imports)
    assert main(["train", "--config", str(REPO / "configs" / "tiny.yaml"), *SMALL, f"data.source={corpus}",
                 f"data.cache_dir={root / 'cache'}", f"train.out_dir={out}"]) == 0
    old = os.umask(0o027)  # the export's files must follow the umask (not tempfile's 0600)
    try:
        assert main(["convert", "--to-hf", str(out), "--out", str(hf)]) == 0
    finally:
        os.umask(old)
    return {"run": out, "hf": hf, "corpus": corpus}


def test_default_config_is_llama_shaped() -> None:
    model = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())["model"]
    assert (model["pos_emb"], model["norm"], model["mlp"], model["bias"]) == ("rope", "rmsnorm", "swiglu", False)


def test_default_run_exports_and_transformers_gives_our_logits_and_text(run: dict[str, Path],
                                                                        capsys: pytest.CaptureFixture) -> None:
    from dist_llm.convert import load_checkpoint_model

    hf = run["hf"]
    assert json.loads((hf / "config.json").read_text())["model_type"] == "llama"
    for file in hf.iterdir():
        assert stat.S_IMODE(file.stat().st_mode) == 0o640, file.name  # 0o666 less the umask 0o027
    model = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    ours = load_checkpoint_model(run["run"]).eval()
    ids = torch.tensor([tok("def wrap(text):\n    return")["input_ids"]])
    assert ids.tolist()[0] == list(b"def wrap(text):\n    return")  # byte-level: id = byte, no BOS added
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ours(ids)[..., :256], rtol=0, atol=2e-5)  # fp32 sum order
    # greedy text: transformers' generate through the exported tokenizer = `dist-llm sample --temperature 0`
    assert main(["sample", "--checkpoint", str(run["run"]), "--prompt", "def ", "--max-new-tokens", "16",
                 "--temperature", "0"]) == 0
    ours_text = capsys.readouterr().out.rstrip("\n")
    prompt = tok("def ", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert tok.decode(out[0]) == ours_text


def test_exported_byte_tokenizer_round_trips_like_ours(run: dict[str, Path]) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(run["hf"])
    ours = ByteTokenizer()
    text = run["corpus"].read_text()
    ids = tok(text)["input_ids"]
    assert ids == ours.encode(text)
    assert tok.decode(ids) == text == ours.decode(ids)
    # and any id sequence, invalid UTF-8 included, decodes as ours does (U+FFFD per bad stretch)
    noise = torch.randint(0, 256, (4000,), generator=torch.Generator().manual_seed(0)).tolist()
    assert tok.decode(noise) == ours.decode(noise)


def test_exported_bpe_tokenizer_round_trips_like_ours(tmp_path: Path) -> None:
    text = corpus_sample()
    ours = BPETokenizer.train([text], vocab_size=400)
    write_hf_tokenizer(tmp_path, ours.save(tmp_path / "trained"), model_max_length=64)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))  # the family must not matter
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = tok(text)["input_ids"]
    assert ids == ours.encode(text) and len(ids) < len(text.encode()) / 1.5  # really merged
    assert tok.decode(ids) == text == ours.decode(ids)


def test_unexportable_run_is_one_line_naming_the_keys_to_change(run: dict[str, Path], tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    src = tmp_path / "run"
    shutil.copytree(run["run"], src)
    for cfg_file in src.rglob("config.yaml"):  # the same weights described as the old default: RoPE + LayerNorm
        cfg = yaml.safe_load(cfg_file.read_text())
        cfg["model"].update(norm="layernorm", mlp="gelu")
        cfg_file.write_text(yaml.safe_dump(cfg))
        manifest_file = cfg_file.parent / "manifest.json"
        if manifest_file.is_file():  # (a checkpoint's: its manifest vouches for the new text, or convert refuses it)
            manifest = json.loads(manifest_file.read_text())
            manifest["files"]["config.yaml"] = {"bytes": cfg_file.stat().st_size, "sha256": sha256_file(cfg_file)}
            manifest_file.write_text(json.dumps(manifest))
    capsys.readouterr()
    assert main(["convert", "--to-hf", str(src), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err == ("dist-llm: error: model.pos_emb=rope model.norm=layernorm model.mlp=gelu: exports as "
                           "neither GPT-2 nor Llama; to export, train with model.pos_emb=learned (GPT-2) or "
                           "model.norm=rmsnorm model.mlp=swiglu (Llama)\n")
    assert not (tmp_path / "hf").exists()
