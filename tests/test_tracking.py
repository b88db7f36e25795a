"""Where runs report besides metrics.jsonl: per-rank logs, TensorBoard, Weights & Biases offline; and a user's
ds_config.json merged with (and checked against) the dist_llm config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dist_llm.config import ConfigError, load_config
from dist_llm.parallel.data.deepspeed_config import merged_deepspeed_config
from tests.conftest import tiny_overrides
from tests.test_data_parallel import STEPS, corpus, train  # noqa: F401


def test_tensorboard_event_files_hold_the_losses(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    got = train(0, 1, tmp_path, corpus, {"train__tensorboard": True})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    loss = events.Scalars("loss")
    assert [e.step for e in loss] == list(range(1, STEPS + 1))
    assert [e.value for e in loss] == pytest.approx(got["losses"], rel=1e-6)
    assert "grad_norm" in events.Tags()["scalars"] and "tokens_per_s" in events.Tags()["scalars"]


def test_tensorboard_gets_each_moe_layers_imbalance(tmp_path: Path) -> None:
    """A flat list of numbers (moe_layer_imbalance: one per MoE layer) reaches TensorBoard as one scalar per item;
    the nested per-expert counts stay in metrics.jsonl alone (hundreds of series at real sizes)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dist_llm.train.metrics import MetricsLog

    log = MetricsLog(tmp_path / "metrics.jsonl", enabled=True, fresh=True, tensorboard_dir=tmp_path / "tb")
    log.write({"step": 3, "loss": 2.5, "moe_layer_imbalance": [1.25, 2.0], "moe_tokens_per_expert": [[3, 1], [4, 0]]})
    log.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["loss", "moe_layer_imbalance/0", "moe_layer_imbalance/1"]
    assert [(e.step, e.value) for e in events.Scalars("moe_layer_imbalance/1")] == [(3, 2.0)]


def test_wandb_offline_run_beside_the_metrics(tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.setenv("WANDB_SILENT", "true")
    train(0, 1, tmp_path, corpus, {"train__wandb": "offline", "train__max_steps": 3})
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))


def _ds(tmp_path: Path, ds: dict, **extra: object):  # type: ignore[no-untyped-def]
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds))
    cfg = load_config(None, tiny_overrides(tmp_path, parallel__backend="deepspeed", parallel__deepspeed_config=str(path),
                                           **extra))
    return merged_deepspeed_config(cfg, dp=2), path


def test_ds_config_is_merged_over_ours(tmp_path: Path) -> None:
    merged, _ = _ds(tmp_path, {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"overlap_comm": True},
                               "communication_data_type": "fp32"}, train__micro_batch_size=4)
    assert merged["train_micro_batch_size_per_gpu"] == 4  # "auto": ours fills it
    assert merged["zero_optimization"]["overlap_comm"] is True and merged["zero_optimization"]["stage"] == 0
    assert merged["communication_data_type"] == "fp32"


@pytest.mark.parametrize(("ds", "message"), [
    ({"train_micro_batch_size_per_gpu": 8}, "sets train_micro_batch_size_per_gpu=8 but train.micro_batch_size gives 4"),
    ({"zero_optimization": {"stage": 3}}, "sets zero_optimization.stage=3 but parallel.zero_stage gives 0"),
    ({"bf16": {"enabled": True}}, "sets bf16.enabled=True but train.precision gives False"),
])
def test_ds_config_contradictions_name_both_keys(tmp_path: Path, ds: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=r"^parallel.deepspeed_config: .*ds_config.json " + message.replace(".", r"\.")):
        _ds(tmp_path, ds, train__micro_batch_size=4)


def test_ds_config_needs_the_deepspeed_backend(tmp_path: Path) -> None:
    (tmp_path / "ds.json").write_text("{}")
    with pytest.raises(ConfigError, match="^parallel.deepspeed_config: needs parallel.backend=deepspeed"):
        load_config(None, tiny_overrides(tmp_path, parallel__deepspeed_config=str(tmp_path / "ds.json")))
