"""Input files nested past Python's recursion limit: json and yaml recurse once a level, so 100,000 brackets
raised a RecursionError (a RuntimeError, which no reader caught) and printed a traceback. Each reader says so in
one line naming its file or key (a review found them through the CLI)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dist_llm import cli
from dist_llm import hf as hf_module
from dist_llm.config import ConfigError, PeftConfig, load_config, parse_override
from dist_llm.data import prepare_data
from dist_llm.peft import load_adapter
from tests.conftest import tiny_overrides

DEEP = "[" * 100_000 + "]" * 100_000


def test_a_config_file_nested_too_deeply(tmp_path: Path) -> None:
    f = tmp_path / "deep.yaml"
    f.write_text(DEEP)
    with pytest.raises(ConfigError) as info:
        load_config(f)
    assert str(info.value) == f"--config: {f} is nested too deeply to be a config"


def test_an_override_nested_too_deeply_is_taken_as_text() -> None:
    """(an override that is not YAML is a string, as before; its key then decides whether that is valid)"""
    assert parse_override(f"name={DEEP}") == ("name", DEEP)


def test_a_directory_as_config_lists_its_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "b.yaml").write_text("{}")
    (tmp_path / "a.yaml").write_text("{}")
    assert cli.main(["train", "--config", str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"dist-llm: error: --config: {tmp_path} is a directory; give one of its YAML files (a.yaml, b.yaml)"]


def test_a_hugging_face_config_or_index_nested_too_deeply(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(DEEP)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(tmp_path / 'config.json'))}: not valid JSON "
                                          r"\(maximum recursion depth exceeded"):
        hf_module.load_hf(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(DEEP)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(index))}: not a weight index"):
        hf_module.read_weight_map(index)


def test_a_safetensors_header_nested_too_deeply(tmp_path: Path) -> None:
    file = tmp_path / "w.safetensors"
    header = DEEP.encode()
    file.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(file))}: cannot read weights .*nested too deeply"):
        hf_module._safetensors_header(file)


def test_a_record_nested_too_deeply_names_its_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n' + DEEP + "\n")
    cfg = load_config(None, tiny_overrides(tmp_path, data__source=str(bad), data__cache_dir=str(tmp_path / "c")))
    with pytest.raises(ConfigError) as info:
        prepare_data(cfg.data, cfg.model.vocab_size)
    assert str(info.value) == f"data.source: {bad}:2 is nested too deeply to be a record"


def test_an_adapter_json_nested_too_deeply(tmp_path: Path) -> None:
    (tmp_path / "adapter.json").write_text(DEEP)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(tmp_path / 'adapter.json'))}: unreadable \(maximum "
                                          "recursion depth exceeded"):
        load_adapter(None, tmp_path, PeftConfig(method="lora"))  # type: ignore[arg-type] (refused before the model)


def test_a_deepspeed_config_nested_too_deeply(tmp_path: Path) -> None:
    from dist_llm.parallel.data.deepspeed_config import merged_deepspeed_config

    f = tmp_path / "ds.json"
    f.write_text(DEEP)
    cfg = load_config(None, tiny_overrides(tmp_path, parallel__backend="deepspeed", parallel__deepspeed_config=str(f)))
    with pytest.raises(ConfigError, match=rf"^parallel.deepspeed_config: cannot read {re.escape(str(f))}: maximum "
                                          "recursion depth exceeded"):
        merged_deepspeed_config(cfg, 1)


def test_a_run_folder_nested_too_deeply_for_the_report(tmp_path: Path) -> None:
    """`dist-llm report` names the config.yaml; a metrics.jsonl line nested that deep is skipped, as a line that is
    not JSON is (and a resume's truncation keeps it: not one of the run's own)."""
    from dist_llm.train.metrics import read_metrics, truncate_after
    from dist_llm.train.report import build_report

    (tmp_path / "config.yaml").write_text(DEEP)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n' + DEEP + '\n{"step": 3, "loss": 1.0}\n')
    with pytest.raises(ConfigError) as info:
        build_report(tmp_path)
    assert str(info.value) == f"report: {tmp_path / 'config.yaml'} is nested too deeply to be a config"
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 2.0}, {"step": 3, "loss": 1.0}]
    assert truncate_after(tmp_path / "metrics.jsonl", 2) == 1
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 2.0}\n' + DEEP + "\n"
