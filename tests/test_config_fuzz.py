"""Config fuzzing: any value for any key either loads (and trains) or is refused with one line (exit 2)."""

from __future__ import annotations

import os
import sys
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dist_llm import cli
from dist_llm.config import SECTIONS, ConfigError, all_keys, load_config

# Keys the training fuzz leaves alone: they would make one step take minutes (compile), reach the network
# (W&B online), or write outside the test's directory (out_dir).
LEFT_ALONE = {"train.compile", "train.wandb", "train.out_dir"}


def _annotation(key: str) -> Any:
    if key == "name":
        return str
    section, _, name = key.partition(".")
    return typing.get_type_hints(SECTIONS[section])[name]


def _valid_looking(key: str) -> st.SearchStrategy:
    """Values of the key's own type, small enough to train in milliseconds, plus its choices."""
    ann = _annotation(key)
    if get_origin(ann) is Literal:
        return st.sampled_from(get_args(ann))
    if get_origin(ann) is list:
        return st.lists(st.one_of(st.integers(-2, 8), st.sampled_from(["qkv", "proj", "mlp", "all", "x"])),
                        max_size=3)
    if ann is bool:
        return st.booleans()
    if ann is int:
        return st.integers(-2, 8)
    if ann is float:
        return st.one_of(st.floats(-1, 2), st.sampled_from([0.0, 1e-3, float("nan"), float("inf")]))
    return st.one_of(st.sampled_from(["", "none", "auto", "./missing", "byte"]), st.text(max_size=8))


ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.lists(st.integers(-5, 5), max_size=3), st.dictionaries(st.text(max_size=3),
                                                                                     st.integers(), max_size=2))
RAW_TEXT = st.sampled_from(["", "[", "{a: 1", "]]", "=", "1e999", "-.inf", ".nan", "0x10", "~", "yes", "'"])


def override(key: str, value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True).strip()
    return f"{key}={text.removesuffix(chr(10) + '...').removesuffix(' ...')}"


@st.composite
def fuzzed_overrides(draw: st.DrawFn, wide: bool) -> list[str]:
    keys = draw(st.lists(st.sampled_from(all_keys()), min_size=1, max_size=3, unique=True))
    out = []
    for key in keys:
        if wide and draw(st.booleans()):
            out.append(f"{key}={draw(RAW_TEXT)}" if draw(st.booleans()) else override(key, draw(ANY_VALUE)))
        else:
            out.append(override(key, draw(_valid_looking(key))))
    return out


@settings(max_examples=400, derandomize="CI" in os.environ, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fuzzed_overrides(wide=True))
def test_any_value_loads_or_is_one_line_naming_the_key(overrides: list[str]) -> None:
    try:
        load_config(None, overrides)
    except ConfigError as e:
        message = str(e)
        assert message and "\n" not in message
        # it names a key: the one set, or the one it conflicts with (micro_batch_size against global_batch_size)
        named = [o.partition("=")[0] for o in overrides]
        assert (message.startswith(tuple(f"{k}:" for k in all_keys())) or any(k in message for k in named)
                or message.startswith("override")), (overrides, message)


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import sysconfig

    path = tmp_path_factory.mktemp("fuzz") / "corpus.txt"
    path.write_text((Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text())
    return path


TINY = ["model.n_layer=1", "model.n_head=2", "model.n_embd=16", "model.block_size=16", "train.micro_batch_size=2",
        "train.global_batch_size=2", "train.max_steps=2", "train.eval_interval=0", "train.log_interval=1",
        "optim.warmup_steps=1", "train.device=cpu", "train.plot=false"]  # (a drawn train.plot=true comes after)


@settings(max_examples=int(os.environ.get("FUZZ_TRAIN_EXAMPLES", "100")), derandomize="CI" in os.environ, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(overrides=fuzzed_overrides(wide=False))
def test_any_value_trains_or_exits_2_with_one_line(overrides: list[str], small_corpus: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # relative paths drawn for data.cache_dir and the like land here
    overrides = [o for o in overrides if o.partition("=")[0] not in LEFT_ALONE]
    out = tmp_path / f"run{abs(hash(tuple(overrides)))}"
    argv = ["train", *TINY, f"data.source={small_corpus}", f"train.out_dir={out}", *overrides]
    capsys.readouterr()
    code = cli.main(argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("dist-llm: error:")]
    assert "Traceback" not in err, (overrides, err[-3000:])
    assert code in (0, 2), (overrides, code, err[-3000:])
    if code == 2:
        assert len(errors) == 1, (overrides, err[-3000:])
    else:
        assert not errors and (out / "metrics.jsonl").is_file(), (overrides, err[-3000:])


def test_device_cuda_on_a_cpu_machine_is_one_line(small_corpus: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: train.device=cuda is valid here")
    code = cli.main(["train", *TINY, f"data.source={small_corpus}", f"train.out_dir={tmp_path}", "train.device=cuda"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("dist-llm: error: train.device: ")



@pytest.mark.parametrize("case", ["empty file", "missing file", "empty folder", "smaller than a block",
                                  "tokenizer of another kind", "tokenizer not JSON", "a fifo"])
def test_bad_data_is_one_line(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "blank.txt").write_text("")
    (tmp_path / "short.txt").write_text("a short text, of some forty bytes only.\n")
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_embd": 768}')  # JSON, not a tokenizer
    (tmp_path / "vocab.txt").write_text("hello\nworld\n")
    os.mkfifo(tmp_path / "fifo")
    overrides, expected = {
        "empty file": (["data.source=EMPTY"], "data.source: EMPTY is empty"),
        "missing file": (["data.source=MISSING"], "data.source: file or directory not found: MISSING"),
        "empty folder": (["data.source=FOLDER"], "data.source: every file under FOLDER is empty"),
        "smaller than a block": (["data.source=SHORT", "model.block_size=64", "data.val_fraction=0.5"],
                                 "model.block_size: 64 needs at least 66 tokens, but the training split of "
                                 "data.source has 20; use a larger corpus or a smaller block"),
        "tokenizer of another kind": (["data.source=SHORT", "data.tokenizer=CONFIG", "model.vocab_size=50304"],
                                      "data.tokenizer: CONFIG is not a Hugging Face tokenizer.json ("),
        "tokenizer not JSON": (["data.source=SHORT", "data.tokenizer=VOCAB", "model.vocab_size=50304"],
                               "data.tokenizer: VOCAB is not a Hugging Face tokenizer.json ("),
        "a fifo": (["data.source=FIFO"], "data.source: FIFO is not a regular file or directory"),
    }[case]
    names = {"EMPTY": tmp_path / "empty.txt", "MISSING": tmp_path / "missing.txt", "FOLDER": tmp_path / "folder",
             "SHORT": tmp_path / "short.txt", "CONFIG": tmp_path / "config.json", "VOCAB": tmp_path / "vocab.txt",
             "FIFO": tmp_path / "fifo"}
    for name, path in names.items():
        overrides = [o.replace(name, str(path)) for o in overrides]
        expected = expected.replace(name, str(path))
    code = cli.main(["train", *TINY, f"train.out_dir={tmp_path / 'run'}",
                     f"data.cache_dir={tmp_path / 'cache'}", *overrides])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"dist-llm: error: {expected}"), err


def test_a_data_source_this_process_cannot_read_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    src = (tmp_path / "corpus.txt").resolve()
    src.write_text("text " * 200)
    real_open = os.open

    def refusing(path: object, *args: Any, **kwargs: Any) -> int:
        # as a file without read permission would (the tests run as root, which a chmod does not stop)
        if Path(path) == src:  # type: ignore[arg-type]
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)
    code = cli.main(["train", *TINY, f"data.source={src}", f"train.out_dir={tmp_path / 'run'}",
                     f"data.cache_dir={tmp_path / 'cache'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"dist-llm: error: data.source: cannot read {src}: Permission denied"], err


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
