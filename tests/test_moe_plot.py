"""moe.png: an MoE run's expert load over steps, drawn beside loss.png from metrics.jsonl; none for a dense run."""

from __future__ import annotations

import json
from pathlib import Path

from dist_llm.train.metrics import plot_losses, plot_moe

PNG = b"\x89PNG\r\n\x1a\n"


def _write(run: Path, moe: bool) -> Path:
    run.mkdir()
    lines = [{"event": "start", "step": 0, "n_params": 1000}]
    for step in range(1, 6):
        rec = {"step": step, "loss": 5.0 - 0.1 * step, "lr": 1e-3}
        if moe:  # the fields the trainer writes at log steps of an MoE run
            rec.update(moe_aux_loss=1.0 + 0.1 / step, moe_z_loss=0.5, moe_imbalance=3.0 - 0.3 * step,
                       moe_dropped_fraction=0.05 / step)
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


def test_report_links_the_moe_plot_only_for_an_moe_run(tmp_path: Path) -> None:
    from dist_llm.config import load_config
    from dist_llm.train.report import write_report

    for name, moe in (("moe", True), ("dense", False)):
        path = _write(tmp_path / name, moe=moe)
        (path.parent / "config.yaml").write_text(load_config(None, [f"train.out_dir={path.parent}"]).to_yaml())
        report = write_report(path.parent).read_text()
        assert ("![expert load](moe.png)" in report) is moe
