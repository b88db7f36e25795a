"""Starting from trained weights (model.init_from) and fine-tuning records with masked prompts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_llm.config import ConfigError, load_config
from dist_llm.data import get_batch, prepare_data
from dist_llm.parallel.context import ParallelContext
from dist_llm.train.trainer import Trainer
from tests.conftest import tiny_overrides
from tests.distributed import run_distributed
from tests.test_data_parallel import assert_same_run, corpus, reference, train  # noqa: F401
from tests.test_hf import hf_llama, hf_logits, save
from tests.test_peft import LORA


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    return save(hf_llama(), tmp_path_factory.mktemp("hf") / "llama")


def test_init_from_hf_takes_its_architecture_and_weights(tmp_path: Path, llama_dir: Path, corpus: Path) -> None:  # noqa: F811
    import transformers

    cfg = load_config(None, tiny_overrides(tmp_path, data__source=str(corpus), model__init_from=f"hf:{llama_dir}"))
    trainer = Trainer(cfg, ParallelContext.from_config(cfg))
    m = trainer.cfg.model
    assert (m.pos_emb, m.norm, m.mlp, m.n_embd, m.kv_heads, m.tie_embeddings) == ("rope", "rmsnorm", "swiglu", 64, 2, False)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = trainer.module.eval()(tokens)
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    torch.testing.assert_close(ours, hf_logits(hf, tokens), rtol=1e-5, atol=1e-5)


def test_lora_from_hf_at_tp2_matches_one_process(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                 llama_dir: Path, corpus: Path) -> None:  # noqa: F811
    extra = {**LORA, "model__init_from": f"hf:{llama_dir}"}
    results = run_distributed(train, 2, tmp_path, corpus, {**extra, "parallel__tp": 2}, init_group=False)
    ref = reference(tmp_path_factory, corpus, **extra)
    assert_same_run(results[0], ref, rtol=1e-5)


def test_init_from_a_checkpoint(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    first = train(0, 1, tmp_path / "a", corpus, {"train__stop_after_step": 3, "train__ckpt_interval": 3})
    cfg = load_config(None, tiny_overrides(tmp_path / "b", data__source=str(corpus), model__bias=False,
                                           model__init_from=f"ckpt:{tmp_path / 'a' / 'checkpoints' / 'step_000003'}"))
    trainer = Trainer(cfg, ParallelContext.from_config(cfg))
    assert trainer.step == 0  # a start, not a resume: optimizer and data order begin afresh
    for name, p in trainer.module.named_parameters():
        torch.testing.assert_close(p, first["params"][name], rtol=0, atol=0)
    other = load_config(None, tiny_overrides(tmp_path / "c", data__source=str(corpus), model__n_embd=64,
                                             model__init_from=f"ckpt:{tmp_path / 'a' / 'checkpoints' / 'step_000003'}"))
    with pytest.raises(ConfigError, match="holds a different model than the model.* settings describe"):
        Trainer(other, ParallelContext.from_config(other))


def _records(path: Path, n: int = 200) -> Path:
    lines = [json.dumps({"prompt": f"Q{i}: add {i} and {i}. A:", "completion": f" {2 * i}"}) for i in range(n)]
    path.write_text("\n".join(lines + [json.dumps({"text": "plain text is learned whole"})]) + "\n")
    return path


def test_records_mask_prompt_targets(tmp_path: Path) -> None:
    cfg = load_config(None, tiny_overrides(tmp_path, data__source=str(_records(tmp_path / "r.jsonl")),
                                           data__cache_dir=str(tmp_path / "cache")))
    data = prepare_data(cfg.data, cfg.model.vocab_size)
    tokens, mask = data.train_tokens(), data.train_mask()
    assert mask is not None and len(mask) == len(tokens) and 0 < mask.mean() < 1
    text = bytes(tokens[:200].astype(np.uint8)).decode()
    first = text.split("\n")[0]
    prompt, completion = first.split("A:")[0] + "A:", first.split("A:")[1]
    assert mask[: len(prompt)].sum() == 0 and mask[len(prompt) : len(first) + 1].all()  # completion and "\n"
    x, y = get_batch(tokens, np.array([0]), 32, mask=mask)
    assert (y[0, : len(prompt) - 1] == -100).all()  # targets inside the prompt are skipped
    assert y[0, len(prompt) - 1].item() == ord(completion[0])  # the prompt's last position predicts the answer
    assert x[0].tolist() == tokens[:32].astype(np.int64).tolist()  # inputs are never masked


def test_records_train_at_tp2_like_one_process(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    source = _records(tmp_path_factory.mktemp("sft") / "r.jsonl")
    results = run_distributed(train, 2, tmp_path, source, {"parallel__tp": 2}, init_group=False)
    assert_same_run(results[0], reference(tmp_path_factory, source), rtol=1e-5)


def test_bad_records_name_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a"}\n')
    cfg = load_config(None, tiny_overrides(tmp_path, data__source=str(bad), data__cache_dir=str(tmp_path / "c")))
    with pytest.raises(ConfigError, match=rf"^data.source: {bad}:2 needs string fields prompt and completion, or text$"):
        prepare_data(cfg.data, cfg.model.vocab_size)
    bad.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(ConfigError, match=rf"^data.source: {bad}:2 is not JSON"):
        prepare_data(cfg.data, cfg.model.vocab_size)


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_peft_run_exports_its_merged_model(tmp_path: Path, llama_dir: Path, corpus: Path, method: str,  # noqa: F811
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A LoRA (or QLoRA) fine-tune of a Hugging Face model: its checkpoint holds the adapter only, yet it
    samples (base rebuilt from init_from) and exports to Hugging Face as the merged model, merged tensor by
    tensor (the export builds no model)."""
    import transformers

    from dist_llm.convert import convert_checkpoint_to_hf
    from dist_llm.sample import load_model

    train(0, 1, tmp_path / "run", corpus, {**LORA, "peft__method": method, "model__init_from": f"hf:{llama_dir}",
                                           "train__max_steps": 3})
    model, _ = load_model(tmp_path / "run", torch.device("cpu"))
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = model(tokens)
    before = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    assert (adapted - hf_logits(before, tokens)).abs().max() > 1e-3  # training moved it
    def no_whole_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the export built the whole model")

    monkeypatch.setattr("dist_llm.train.trainer.build_model", no_whole_model)
    monkeypatch.setattr("dist_llm.sample.load_model", no_whole_model)
    out = convert_checkpoint_to_hf(tmp_path / "run", tmp_path / "hf", max_shard_size="100KB")
    assert (out / "model.safetensors.index.json").is_file()  # sharded, and still the same model
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(hf_logits(exported, tokens), adapted, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_shipped_finetune_configs_lower_the_loss(tmp_path: Path, method: str) -> None:
    """The shipped configs' hyperparameters learn the demo task, through the 20 warm-up steps to the peak rate and
    past it: 25 steps take the loss from 5.63 (step 1) to ~4.12 for both methods (measured, logged every step;
    4.06 at 40, where it flattens). The test asks for 1.0 of that 1.5: a step moves it by up to 0.2."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo", Path(__file__).parent.parent / "scripts" / "make_finetune_demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)  # type: ignore[union-attr]
    base, data = demo.make(tmp_path / "demo", records=500)
    cfg = load_config(Path(__file__).parent.parent / "configs" / f"finetune-{method}.yaml", [
        f"model.init_from=hf:{base}", f"data.source={data}", f"data.cache_dir={tmp_path / 'cache'}",
        f"train.out_dir={tmp_path / 'run'}", "train.max_steps=25", "train.eval_interval=0", "train.log_interval=1",
        "train.plot=false"])
    last = Trainer(cfg, ParallelContext.from_config(cfg)).fit()
    first = next(r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if "loss" in r)
    assert first["step"] == 1 and last["loss"] < first["loss"] - 1.0


def test_qlora_from_a_checkpoint_quantises_its_weights(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    """peft.method=qlora with model.init_from=ckpt: the weights come through DCP's load, each block linear
    read alone and quantised before the next (peft/qlora.py); each NF4 base equals NF4 of the checkpoint's
    weight."""
    from dist_llm.peft.nf4 import NF4Linear, NF4Weight
    from dist_llm.sample import load_model

    train(0, 1, tmp_path / "base", corpus, {"train__max_steps": 2, "train__ckpt_interval": 2})
    step = tmp_path / "base" / "checkpoints" / "step_000002"
    cfg = load_config(None, tiny_overrides(tmp_path / "q", data__source=str(corpus), model__bias=False,
                                           peft__method="qlora", peft__rank=4, model__init_from=f"ckpt:{step}"))
    trainer = Trainer(cfg, ParallelContext.from_config(cfg))
    try:
        assert not any(p.is_meta for p in trainer.module.parameters())
        base, _ = load_model(step, torch.device("cpu"))
        layer = trainer.module.blocks[0].attn.qkv
        assert isinstance(layer, NF4Linear)
        expected = NF4Weight.quantize(base.blocks[0].attn.qkv.weight.detach())
        assert torch.equal(layer.nf4_weight().packed, expected.packed)
        torch.testing.assert_close(trainer.module.wte.weight, base.wte.weight, rtol=0, atol=0)
    finally:
        trainer.ctx.destroy()


def test_a_base_replaced_at_the_same_path_is_refused_by_resume_sample_and_export(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, llama_dir: Path, corpus: Path) -> None:  # noqa: F811
    """A LoRA checkpoint names its base by path: another model of the same shapes put there (another revision,
    a fine-tuned copy) was adapted and exported merged without a word (a review: every exported tensor differed).
    The manifest keeps a digest of a sample of the base's files; each reader compares it with what is there."""
    from dist_llm.convert import convert_checkpoint_to_hf
    from dist_llm.sample import load_model

    base = tmp_path / "base"
    shutil.copytree(llama_dir, base)
    run = tmp_path / "run"
    extra = {**LORA, "model__init_from": f"hf:{base}", "train__ckpt_interval": 2}
    train(0, 1, run, corpus, {**extra, "train__stop_after_step": 2})
    step = run / "checkpoints" / "step_000002"
    saved = json.loads((step / "manifest.json").read_text())["peft_base"]
    assert len(saved["weights"]) == 32  # (the digest's hex characters)

    torch.manual_seed(1)  # the same architecture, other weights
    shutil.rmtree(base)
    save(hf_llama(), base)
    refusal = (f"the base model in {base} is not the one {step} was trained on (a sample of its weight files "
               "differs: replaced, changed or re-sharded since); point {to} at that model")
    with pytest.raises(ConfigError) as info:
        train(0, 1, run, corpus, extra)
    assert str(info.value) == "train.resume: " + refusal.format(to="model.init_from")
    with pytest.raises(ConfigError) as info:
        load_model(run, torch.device("cpu"))
    assert str(info.value) == "sample: " + refusal.format(to="--init-from")
    with pytest.raises(ConfigError) as info:
        convert_checkpoint_to_hf(run, tmp_path / "hf")
    assert str(info.value) == "convert --to-hf: " + refusal.format(to="model.init_from")
    assert not (tmp_path / "hf").exists()

    manifest = json.loads((step / "manifest.json").read_text())  # a damaged digest is damage, not another base
    (step / "manifest.json").write_text(json.dumps({**manifest, "peft_base": {**saved, "weights": 123}}))
    with pytest.raises(ConfigError) as info:
        load_model(run, torch.device("cpu"))
    assert str(info.value) == f"sample: {step / 'manifest.json'}: peft_base.weights is 123, not a digest (a damaged manifest)"
    (step / "manifest.json").write_text(json.dumps(manifest))

    shutil.rmtree(base)
    shutil.copytree(llama_dir, base)  # the original back (a copy: same bytes, new files): all three go on
    load_model(run, torch.device("cpu"))
    convert_checkpoint_to_hf(run, tmp_path / "hf")
    assert train(0, 1, run, corpus, extra)["losses"] == reference(tmp_path_factory, corpus, **extra)["losses"]
