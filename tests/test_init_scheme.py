"""The init scheme a checkpoint records: a PEFT base rebuilt from train.seed (sample, convert --to-hf, resume) is
refused in one line where the checkpoint's scheme draws the model's values otherwise than this version's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dist_llm import sample
from dist_llm.config import ConfigError, load_config
from dist_llm.model import GPT
from dist_llm.model import init as model_init
from dist_llm.train import checkpoint as ckpt
from tests.conftest import tiny_overrides
from tests.test_data_parallel import corpus, train  # noqa: F401 - corpus: fixture
from tests.test_moe_lora import LORA, MOE


def _meta(tmp_path: Path, **extra: object) -> GPT:
    with torch.device("meta"):
        return GPT(load_config(None, tiny_overrides(tmp_path, **extra)).model)


def test_drawn_otherwise_names_stacks_and_multi_chunk_parameters(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Scheme 2 draws a stack of experts one expert per generator and a parameter over CHUNK_NUMEL elements by
    chunks: those differ from scheme 1's one generator over the whole; a one-chunk parameter does not, nor,
    given the model's rule, one filled with a constant."""
    assert model_init.drawn_otherwise(_meta(tmp_path)) == []
    moe = _meta(tmp_path, **MOE)
    weights = ["blocks.1.moe.experts.w_up", "blocks.1.moe.experts.w_gate", "blocks.1.moe.experts.w_down"]
    biases = ["blocks.1.moe.experts.b_up", "blocks.1.moe.experts.b_gate", "blocks.1.moe.experts.b_down"]
    assert model_init.drawn_otherwise(moe) == weights + biases
    assert model_init.drawn_otherwise(moe, moe._init_rule) == weights  # (zero biases: the same in any scheme)
    monkeypatch.setattr(model_init, "CHUNK_NUMEL", 256 * 32 // 2)  # the 256 x 32 embedding: two chunks
    assert model_init.drawn_otherwise(_meta(tmp_path)) == ["wte.weight"]


def test_a_seeded_peft_base_of_another_scheme_is_refused(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    """A LoRA run on a random MoE base (its experts' values differ between schemes): its checkpoint records
    scheme 2 and is sampled and exported; with the manifest's `init_scheme` removed (a checkpoint of scheme 1)
    sampling, export and resume each refuse it in one line. A dense tiny model draws the same in both: accepted."""
    from dist_llm.convert import CheckpointWeights, MergedPeft

    run = tmp_path / "run"
    train(0, 1, run, corpus, {**LORA, "train__max_steps": 2, "train__ckpt_interval": 2})
    path = run / "checkpoints" / "step_000002"
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    assert manifest["init_scheme"] == model_init.INIT_SCHEME == 2
    cfg = load_config(None, tiny_overrides(run, **LORA))
    sample.load_model(path, torch.device("cpu"))
    MergedPeft(CheckpointWeights(path), cfg)

    del manifest["init_scheme"]  # (the manifest lists the other files' hashes, not its own)
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    line = (f"{path} adapts a base drawn from train.seed by init scheme 1, which this version (2) draws otherwise "
            "(blocks.1.moe.experts.w_up and 2 more): its base cannot be rebuilt; use the dist_llm version that "
            "trained it")
    with pytest.raises(ConfigError) as e:
        sample.load_model(path, torch.device("cpu"))
    assert str(e.value) == f"sample: {line}"
    with pytest.raises(ConfigError) as e:
        MergedPeft(CheckpointWeights(path), cfg)
    assert str(e.value) == f"convert --to-hf: {line}"
    with pytest.raises(ConfigError) as e:
        train(0, 1, run, corpus, {**LORA, "train__max_steps": 4})
    assert str(e.value) == f"train.resume: {line}"
    dense = load_config(None, tiny_overrides(run, peft__method="lora"))
    ckpt.check_seeded_base(path, dense, what="sample")  # (scheme 1 drew the same values for this model)
