"""What a process pays to start: every rank of a torchrun world and every CLI command imports dist_llm."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_IMPORT_ALL = """
import importlib, pkgutil, sys
import dist_llm
for m in pkgutil.walk_packages(dist_llm.__path__, "dist_llm."):
    importlib.import_module(m.name)
    if "torch._dynamo" in sys.modules:
        sys.exit(f"{m.name} imports torch._dynamo")
"""


def test_no_module_loads_the_compiler_on_import() -> None:
    """torch._dynamo costs ~2 s of a process's start on 2 cores (sympy, the tracer): importing every dist_llm module
    in a fresh interpreter leaves it unloaded (the collectives kept out of compiled graphs used
    torch.compiler.disable at import time, which loads it: dist_llm/compiling.py). sample, convert, memory, report
    and the refusals of a bad config start that much sooner; training loads it with torch.optim anyway."""
    proc = subprocess.run([sys.executable, "-c", _IMPORT_ALL], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
