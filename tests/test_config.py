"""Config loading, overrides and the one-line errors for bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dist_llm.config import Config, ConfigError, config_from_dict, load_config

REPO = Path(__file__).resolve().parents[1]


def test_defaults_then_file_then_overrides(tmp_path: Path) -> None:
    f = tmp_path / "run.yaml"
    f.write_text("model:\n  n_layer: 3\n  n_embd: 64\noptim:\n  lr: 1.0e-3\n")
    cfg = load_config(f, ["model.n_layer=5", "optim.lr=5e-3", "train.precision=bf16", "model.bias=false"])
    assert cfg.model.n_layer == 5  # CLI beats the file
    assert cfg.model.n_embd == 64  # the file beats the default
    assert cfg.model.n_head == Config().model.n_head  # the default stays
    assert cfg.optim.lr == pytest.approx(5e-3) and isinstance(cfg.optim.lr, float)
    assert cfg.train.precision == "bf16" and cfg.model.bias is False
    assert cfg.name == "run"  # named after the file


def test_int_accepted_for_float_and_round_trip(tmp_path: Path) -> None:
    cfg = load_config(None, ["optim.lr=1", "optim.min_lr=0"])
    assert cfg.optim.lr == 1.0
    assert config_from_dict(cfg.to_dict()) == cfg


def test_a_quoted_integer_is_read_exactly(tmp_path: Path) -> None:
    """A string of digits for an int key is read as an integer, not through a float (2**53 + 1 has no float)."""
    path = tmp_path / "c.yaml"
    path.write_text('train:\n  max_steps: "9007199254740993"\n  seed: "1_000"\n')
    cfg = load_config(path, [])
    assert (cfg.train.max_steps, cfg.train.seed) == (2**53 + 1, 1000)


def test_shipped_configs_load(tmp_path: Path) -> None:
    demo = tmp_path / "demo"  # the fine-tuning configs read files scripts/make_finetune_demo.py writes
    (demo / "hf-base").mkdir(parents=True)
    (demo / "train.jsonl").write_text('{"text": "x"}\n')
    for path in sorted((REPO / "configs").glob("*.yaml")):
        extra = ([f"model.init_from=hf:{demo / 'hf-base'}", f"data.source={demo / 'train.jsonl'}"]
                 if path.name.startswith("finetune-") else [])
        load_config(path, extra)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.n_layr=2"], "unknown config key 'model.n_layr' (did you mean 'model.n_layer'?)"),
        (["trian.max_steps=2"], "unknown config key 'trian.max_steps' (did you mean 'train.max_steps'?)"),
        (["model.n_layer=abc"], "model.n_layer: expected an integer, got 'abc'"),
        (["model.n_layer=2.5"], "model.n_layer: expected an integer, got 2.5"),
        (["model.bias=maybe"], "model.bias: expected true or false, got 'maybe'"),
        (["model.pos_emb=sinusoid"], "model.pos_emb: must be one of learned|rope|alibi, got 'sinusoid'"),
        (["model.n_embd=100", "model.n_head=3"], "model.n_embd: 100 is not divisible by model.n_head=3"),
        (["model.n_head=4", "model.n_kv_head=3"], "model.n_head: 4 is not divisible by model.n_kv_head=3"),
        (["train.global_batch_size=10", "train.micro_batch_size=4"],
         "train.global_batch_size: 10 is not divisible by train.micro_batch_size * parallel.dp = 4 * 1"),
        (["model.n_layer=0"], "model.n_layer: must be positive, got 0"),
        (["data.source=/no/such/corpus"], "data.source: file or directory not found: /no/such/corpus"),
        (["model.vocab_size=100"], "model.vocab_size: the byte tokenizer needs at least 256, got 100"),
        (["parallel.pp=5"], "parallel.pp: 5 stages need at least as many blocks, model.n_layer=4"),
        (["parallel.pp=2", "parallel.pp_layers=[1, 2]"],
         "parallel.pp_layers: [1, 2] must be 2 positive counts summing to model.n_layer=4"),
        (["parallel.pp=2", "parallel.zero_stage=3", "parallel.offload=cpu"],
         "parallel.offload=cpu is not supported with parallel.pp>1; use parallel.offload=none"),
        (["parallel.pp=2", "parallel.zero_stage=3", "parallel.pp_schedule=zb1", "parallel.reshard_after_forward=true"],
         "parallel.reshard_after_forward: true with parallel.zero_stage=3 and pp_schedule=zb1 would regather each "
         "unit between B and W; leave it unset (false under a pipeline)"),
        (["parallel.pp=2", "parallel.zero_stage=2", "parallel.pp_reduce_grads=micro_batch"],
         "parallel.pp_reduce_grads: micro_batch applies to parallel.zero_stage=3 (FSDP2), not zero_stage=2; leave it "
         "at step"),
        (["parallel.pp=2", "parallel.zero_stage=3", "parallel.pp_schedule=zb1", "parallel.pp_reduce_grads=micro_batch"],
         "parallel.pp_reduce_grads: micro_batch with pp_schedule=zb1: its weight-gradient pass computes the stage's "
         "gradients together, outside FSDP2's hooks; use pp_schedule=1f1b, interleaved or gpipe, or "
         "pp_reduce_grads=step"),
        (["parallel.zero_stage=3", "parallel.pp_reduce_grads=micro_batch"],
         "parallel.pp_reduce_grads: micro_batch applies under a pipeline (parallel.pp > 1); without one ZeRO-3 "
         "reduce-scatters every micro-step already"),
        (["parallel.pp_reduce_grads=sometimes"],
         "parallel.pp_reduce_grads: must be one of step|micro_batch, got 'sometimes'"),
        (["parallel.pp=2", "parallel.backend=deepspeed"],
         "parallel.backend: deepspeed is not supported with parallel.pp>1; use backend=native"),
        (["parallel.tp=2", "parallel.backend=deepspeed"],
         "parallel.backend: deepspeed is not supported with parallel.tp>1; use backend=native"),
        (["parallel.tp=3"], "model.n_head: 4 is not divisible by parallel.tp=3"),
        (["parallel.tp=4", "model.n_head=12", "model.n_kv_head=6", "model.n_embd=96"],
         "model.n_kv_head: 6 KV heads neither split over parallel.tp=4 nor divide it"),
        (["parallel.tp=2", "model.vocab_size=257", "model.pad_vocab_to=1"],
         "model.pad_vocab_to: the vocabulary padded to 257 is not divisible by parallel.tp=2"),
        (["parallel.tp=2", "parallel.sequence_parallel=true", "model.block_size=127"],
         "parallel.sequence_parallel: model.block_size=127 is not divisible by parallel.tp=2"),
        (["parallel.offload=cpu"], "parallel.offload=cpu needs parallel.zero_stage=3"),
        (["parallel.backend=megatron"], "parallel.backend: must be one of native|deepspeed, got 'megatron'"),
        (["parallel.zero_stage=4"], "parallel.zero_stage: must be 0, 1, 2 or 3, got 4"),
        (["optim.min_lr=1", "optim.lr=0.1"], "optim.min_lr: 1.0 is above optim.lr=0.1"),
        (["model.n_layer"], "override 'model.n_layer': expected section.key=value"),
    ],
)
def test_bad_values_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("value", ["", "'  '"])
def test_an_empty_data_source_is_refused_not_read_as_the_current_folder(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"data.source={value}"])
    assert str(info.value) == ("data.source: is empty; give stdlib, a text file, a folder or a .bin/.jsonl file "
                               "(. for the current folder)")


@pytest.mark.parametrize("value", ["0.000001", "0.5"])
def test_a_collective_timeout_under_a_second_is_refused(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"parallel.timeout_s={value}"])
    assert str(info.value) == (f"parallel.timeout_s: must be at least 1 second, got {float(value):g} (the time a "
                               f"collective may wait for every rank)")
    assert load_config(None, ["parallel.timeout_s=1"]).parallel.timeout_s == 1.0


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--config: file not found"):
        load_config(tmp_path / "nope.yaml")


def test_unknown_key_in_file(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("optim:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="unknown config key 'optim.learning_rate'"):
        load_config(f)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dist_llm.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["train", "model.n_layr=2"], "model.n_layr"),
        (["train", "model.n_embd=100", "model.n_head=3"], "model.n_embd"),
        (["train", "model.n_kv_head=3"], "model.n_kv_head=3"),
        (["train", "train.global_batch_size=33"], "train.global_batch_size"),
        (["train", "--config", "/no/such.yaml"], "/no/such.yaml"),
        (["train", "data.source=/no/such/corpus"], "data.source"),
        (["train", "train.resume=/no/such/ckpt"], "train.resume"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(args: list[str], needle: str) -> None:
    proc = _cli(*args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("dist-llm: error: ") and needle in lines[0]
    assert "Traceback" not in proc.stderr
