"""The install (issue 18, item 14): the base dependencies are what training needs, the optional packages are
imported only where they are used, and the `test` extra that `make test` installs holds every package the
tests import, so none of them skips for want of one."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.conftest import REPO, tiny_overrides

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
#: installed by extras only; none may be imported by training
OPTIONAL = ["deepspeed", "accelerate", "transformers", "torchao", "tensorboard", "wandb", "hypothesis", "pytest"]


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement)[0]).lower()


def _extra(name: str) -> set[str]:
    """The distributions an extra names, its references to this project's own extras followed."""
    names: set[str] = set()
    for req in PYPROJECT["project"]["optional-dependencies"][name]:
        if _name(req) == _name(PYPROJECT["project"]["name"]):
            for inner in re.search(r"\[(.*)\]", req)[1].split(","):
                names |= _extra(inner.strip())
        else:
            names.add(_name(req))
    return names


BASE = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
TEST = BASE | _extra("test")


def _imports(path: Path, *, top_level_only: bool) -> set[str]:
    """Top-level names of the modules a file imports (module level only, or anywhere), and importorskip's."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif (not top_level_only and isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "importorskip"
              and node.args and isinstance(node.args[0], ast.Constant)):
            names.add(node.args[0].value.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"dist_llm", "tests", "scripts", "__future__"}


def _distributions(modules: set[str]) -> dict[str, set[str]]:
    """module -> the installed distributions that provide it."""
    provided = importlib.metadata.packages_distributions()
    return {m: {_name(d) for d in provided.get(m, [])} for m in modules}


def test_dist_llm_imports_at_module_level_only_base_dependencies() -> None:
    modules = set().union(*(_imports(p, top_level_only=True) for p in (REPO / "dist_llm").rglob("*.py")))
    outside = {m: d for m, d in _distributions(modules).items() if not d & BASE}
    assert outside == {}, f"dist_llm imports these at module level, outside the base dependencies: {outside}"


def test_the_test_extra_holds_every_package_the_tests_import() -> None:
    modules = set().union(*(_imports(p, top_level_only=False) for p in (REPO / "tests").glob("*.py")))
    missing = {m: d for m, d in _distributions(modules).items() if not d & TEST}
    assert missing == {}, f"tests import these, which neither the base nor the test extra installs: {missing}"
    assert {"deepspeed", "transformers", "torchao", "accelerate", "pytest-xdist"} <= TEST
    assert not BASE & set(OPTIONAL), "an optional package is a base dependency"


def test_the_license_is_an_spdx_string() -> None:
    """`license = {text = ...}` makes setuptools print a deprecation banner at every install."""
    assert PYPROJECT["project"]["license"] == "Apache-2.0"


def test_training_imports_no_optional_package(tmp_path: Path, corpus_file: Path) -> None:
    """Every dist_llm module imported and a step trained through the CLI, in a fresh process: none of the
    optional packages is loaded, so the base install (`make venv`) trains."""
    out = tmp_path / "run"
    args = ["train", *tiny_overrides(out, train__max_steps=1, train__eval_interval=0, model__n_layer=1),
            f"data.source={corpus_file}", f"data.cache_dir={tmp_path / 'cache'}"]
    code = f"""
import importlib, json, pkgutil, sys
import dist_llm
for info in pkgutil.walk_packages(dist_llm.__path__, "dist_llm."):
    if info.name != "dist_llm.train.__main__":
        importlib.import_module(info.name)
from dist_llm.cli import main
rc = main({args!r})
print(json.dumps([rc, sorted({{m.split(".")[0] for m in sys.modules}} & set({OPTIONAL!r}))]))
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rc, loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (rc, loaded) == (0, [])
    assert (out / "metrics.jsonl").is_file()
