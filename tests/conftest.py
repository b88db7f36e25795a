"""Shared test set-up: a data cache that lives for the session (and across xdist workers), tiny configs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Prepared token files are shared by all workers (writes are atomic renames); CI points this into the checkout.
os.environ.setdefault("DIST_LLM_CACHE", str(REPO / ".cache" / "dist_llm"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# DeepSpeed JIT-builds a C++ op on first use; one cache for the whole run
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))


def tiny_overrides(out_dir: Path, **extra: object) -> list[str]:
    """A model small enough that a step takes milliseconds; extra keys as section__key=value."""
    base = {
        "model.n_layer": 2, "model.n_head": 4, "model.n_embd": 32, "model.block_size": 32,
        "train.micro_batch_size": 4, "train.global_batch_size": 8, "train.max_steps": 20,
        "train.log_interval": 1, "train.eval_interval": 10, "train.eval_steps": 2,
        "train.out_dir": str(out_dir), "optim.warmup_steps": 5,
    }
    base.update({k.replace("__", "."): v for k, v in extra.items()})
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture
def corpus_file(tmp_path: Path) -> Path:
    """A ~150 KB text file (fast to prepare; split by position) for trainer tests that need no stdlib."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = ["argparse.py", "dataclasses.py", "functools.py", "json/decoder.py", "textwrap.py", "string.py"]
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join((stdlib / name).read_text() for name in names))
    return path
