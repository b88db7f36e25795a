"""moe.png: an MoE run's expert load over steps, drawn beside loss.png from metrics.jsonl; none for a dense run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dist_llm.train import metrics
from dist_llm.train.metrics import imbalance_lines, plot_losses, plot_moe, read_metrics

PNG = b"\x89PNG\r\n\x1a\n"


def _write(run: Path, moe: bool, blocks: list[int] | None = None) -> Path:
    run.mkdir()
    lines = [{"event": "start", "step": 0, "n_params": 1000, **({"moe_blocks": blocks} if blocks else {})}]
    for step in range(1, 6):
        rec = {"step": step, "loss": 5.0 - 0.1 * step, "lr": 1e-3}
        if moe:  # the fields the trainer writes at log steps of an MoE run
            layers = [3.0 - 0.3 * step, 2.0, 1.5]  # three MoE layers' max/mean
            rec.update(moe_aux_loss=1.0 + 0.1 / step, moe_z_loss=0.5, moe_imbalance=max(layers),
                       moe_dropped_fraction=0.05 / step, moe_layer_imbalance=layers,
                       moe_tokens_per_expert=[[4, 1, 1, 2]] * 3)
        lines.append(rec)
    lines.append({"step": 5, "val_loss": 4.6})
    path = run / "metrics.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_moe_run_gets_an_imbalance_plot_and_a_dense_run_none(tmp_path: Path) -> None:
    moe = _write(tmp_path / "moe", moe=True)
    plot_losses(moe, moe.parent / "loss.png")
    assert (moe.parent / "loss.png").read_bytes().startswith(PNG)
    assert (moe.parent / "moe.png").read_bytes().startswith(PNG)
    dense = _write(tmp_path / "dense", moe=False)
    plot_losses(dense, dense.parent / "loss.png")
    assert (dense.parent / "loss.png").read_bytes().startswith(PNG)
    assert not (dense.parent / "moe.png").exists()
    assert plot_moe(dense, dense.parent / "moe.png") is False
    assert sorted(p.name for p in dense.parent.iterdir()) == ["loss.png", "metrics.jsonl"]  # (no temporary left)


def test_moe_plot_draws_each_layers_imbalance_and_the_max(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path / "moe", moe=True)
    lines = imbalance_lines(read_metrics(path))
    assert list(lines) == ["MoE layer 0", "MoE layer 1", "MoE layer 2", "max over layers"]
    assert lines["MoE layer 0"] == {s: 3.0 - 0.3 * s for s in range(1, 6)} and lines["MoE layer 1"][5] == 2.0
    assert lines["max over layers"] == {1: 2.7, 2: 2.4, 3: 2.1, 4: 2.0, 5: 2.0}
    drawn: list[list[str]] = []  # the labels of the upper panel's curves, as the figure holds them
    save = metrics._save
    monkeypatch.setattr(metrics, "_save", lambda fig, png: (drawn.append([ln.get_label() for ln in fig.axes[0].lines]),
                                                            save(fig, png)))
    assert plot_moe(path, tmp_path / "moe.png")
    assert drawn == [["MoE layer 0", "MoE layer 1", "MoE layer 2", "max over layers", "balanced"]]
    assert (tmp_path / "moe.png").read_bytes().startswith(PNG)
    # the start record says which blocks the MoE layers are (model.moe_every=2 of 6 blocks: 1, 3, 5): labelled so
    by_block = imbalance_lines(read_metrics(_write(tmp_path / "every2", moe=True, blocks=[1, 3, 5])))
    assert list(by_block) == ["block 1", "block 3", "block 5", "max over layers"]
    assert by_block["block 1"] == lines["MoE layer 0"]
    # a run logged before the per-layer field: the max alone, as before
    old = [{"step": 1, "loss": 5.0, "moe_imbalance": 2.5}]
    assert imbalance_lines(old) == {"max over layers": {1: 2.5}}
    assert imbalance_lines([{"step": 1, "loss": 5.0}]) == {}


def test_report_and_summary_name_the_moe_plot_only_for_an_moe_run(tmp_path: Path) -> None:
    """A dense run's out_dir may hold an earlier MoE run's moe.png: neither its report nor its console summary
    names it as this run's."""
    from dist_llm.config import load_config
    from dist_llm.train.report import summary_lines, write_report

    for name, moe in (("moe", True), ("dense", False)):
        path = _write(tmp_path / name, moe=moe)
        (path.parent / "config.yaml").write_text(load_config(None, [f"train.out_dir={path.parent}"]).to_yaml())
        report = write_report(path.parent).read_text()
        assert ("![expert load](moe.png)" in report) is moe
        (path.parent / "moe.png").write_bytes(PNG)
        lines = summary_lines(path.parent, step=5, stop=5, newest=None, command="")
        assert any(line.lstrip().startswith("MoE plot:") for line in lines) is moe, lines


def test_train_plot_false_draws_nothing_and_the_report_links_no_image(tmp_path: Path, corpus_file: Path) -> None:
    from dist_llm.config import load_config
    from dist_llm.parallel.context import ParallelContext
    from dist_llm.train.trainer import Trainer
    from tests.conftest import tiny_overrides

    cfg = load_config(None, tiny_overrides(tmp_path, data__source=str(corpus_file), train__max_steps=2,
                                           model__n_experts=4, model__moe_top_k=2, train__plot=False))
    Trainer(cfg, ParallelContext.from_config(cfg)).fit()
    assert not (tmp_path / "loss.png").exists() and not (tmp_path / "moe.png").exists()
    report = (tmp_path / "report.md").read_text()
    assert "| model states |" in report and "![" not in report
    # an earlier run's plot in the same out_dir is not named as this run's
    from dist_llm.train.report import summary_lines

    (tmp_path / "loss.png").write_bytes(b"earlier")
    lines = summary_lines(tmp_path, step=2, stop=2, newest=None, command="")
    assert any(line.lstrip().startswith("report:") for line in lines)
    assert not any("loss plot:" in line or "MoE plot:" in line for line in lines), lines
