"""The documents say what their own figures say: docs/benchmarks.md's prose quotes its table's numbers, and
the README quotes no test count (a number that drifts with every test added), and the layout rule it states is
the one the code checks."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import pytest

from tests.conftest import REPO

BENCHMARKS = (REPO / "docs" / "benchmarks.md").read_text()

# one row of the all-cpu table: text columns are separated by 2+ spaces (a text may hold single spaces),
# numbers by any (two 14-digit byte counts sit one space apart)
_ROW = re.compile(r"^(?P<scenario>\S+)\s+(?P<ours>.+?)\s{2,}(?P<ref>.+?)\s{2,}(?P<figure>.+?)\s{2,}"
                  r"(?P<ours_v>[\d,]+\.\d+)\s+(?P<ref_v>[\d,]+\.\d+)\s+(?P<ratio>\d+\.\d+)\s+"
                  r"(?P<ours_mib>\d+|-)\s+(?P<ref_mib>\d+|-)\s*(?P<target>.*)$")


@dataclass(frozen=True)
class Row:
    ours_value: float
    ref_value: float
    ratio: float
    ours_mib: int | None
    ref_mib: int | None


def parse_table(md: str) -> tuple[str, dict[tuple[str, str, str], Row]]:
    """(the table's title line, its rows by (scenario, ours, reference))."""
    block = md.split("```\ndist_llm benchmarks:", 1)[1].split("```", 1)[0]
    lines = block.splitlines()
    title = "dist_llm benchmarks:" + lines[0]
    start = next(i for i, line in enumerate(lines) if line.startswith("-----")) + 1
    rows: dict[tuple[str, str, str], Row] = {}
    for line in lines[start:]:
        if not line.strip():
            break
        m = _ROW.match(line)
        assert m, f"not a table row: {line!r}"
        key = (m["scenario"], m["ours"], m["ref"])
        assert key not in rows, key
        mib = [None if m[k] == "-" else int(m[k]) for k in ("ours_mib", "ref_mib")]
        rows[key] = Row(float(m["ours_v"].replace(",", "")), float(m["ref_v"].replace(",", "")), float(m["ratio"]),
                        *mib)
    return title, rows


TITLE, TABLE = parse_table(BENCHMARKS)
PROSE = " ".join(BENCHMARKS.split("```\ndist_llm benchmarks:", 1)[1].split("```", 1)[1].split())


def ratio(scenario: str, ours: str, ref: str, digits: int = 2) -> str:
    return f"{TABLE[scenario, ours, ref].ratio:.{digits}f}"


def mib(scenario: str, ours: str, ref: str) -> str:
    return str(TABLE[scenario, ours, ref].ours_mib)


PP = [(kind, m) for kind in ("gpipe", "1f1b") for m in (1, 4, 8)]
TP = [("tp2", "tp1"), ("tp2-sp", "tp1")]
SCALING = ["dp=2", "dp=4 (oversubscribed)", "tp=2", "tp=4 (oversubscribed)", "pp=2", "pp=4 (oversubscribed)"]


def _pp(kind: str, field: str) -> list[str]:
    rows = [TABLE["pp", f"{kind} m={m}", "(p-1)/(m+p-1)"] for m in (1, 4, 8)]
    return [f"{getattr(r, field):.3f}" if field != "ours_mib" else str(r.ours_mib) for r in rows]


def _tp_mib() -> list[str]:
    ours = [TABLE["tp", a, b].ours_mib for a, b in TP]
    return [str(min(ours)), str(max(ours)), str(TABLE["tp", "tp2", "tp1"].ref_mib)]


def _scaling_mib() -> list[str]:
    ours = [TABLE["scaling", name, "1 process"].ours_mib for name in SCALING]
    return [str(min(ours)), str(max(ours)), str(TABLE["scaling", "dp=2", "1 process"].ref_mib)]


def _theory_excess() -> list[str]:
    rows = [r for (s, _, ref), r in TABLE.items() if s == "dp" and ref == "theory"]
    assert all(abs(r.ours_value - r.ref_value) <= 1e-5 * r.ref_value for r in rows)  # "within 0.001%"
    return [str(int(max(r.ours_value - r.ref_value for r in rows)))]


#: (name, a sentence of the prose (whitespace collapsed) with the numbers it quotes as groups -> those numbers,
#: formatted from the table as the prose rounds them (ratios to 2 places, the Megatron ratios and idle
#: fractions to the table's 3)
CLAIMS: list[tuple[str, str, Callable[[], list[str]]]] = [
    ("ddp", r"Our DDP \(zero 0\) is (\S+)x plain DDP's step time", lambda: [ratio("dp", "ours-zero0", "torch-ddp")]),
    ("fsdp2", r"Our ZeRO-3 \(FSDP2 with our collectives hooked in\) is (\S+)x plain FSDP2",
     lambda: [ratio("dp", "ours-zero3", "torch-fsdp2")]),
    ("deepspeed", r"Our ZeRO-1, 2 and 3 are faster than DeepSpeed's: (\S+)x, (\S+)x, (\S+)x\.",
     lambda: [ratio("dp", f"ours-zero{z}", f"ds-zero{z}") for z in (1, 2, 3)]),
    ("dp-theory", r"within 0\.001% of theory for every stage \(at most (\d+) bytes a step above it\)", _theory_excess),
    ("tp-bytes", r"The bytes are (\S+)x Megatron's count .*?, (\S+)x with sequence parallelism\.",
     lambda: [ratio("tp", name, "Megatron's count", 3) for name in ("tp2", "tp2-sp")]),
    ("tp-time", r"a tp=2 step takes (\S+)x tp=1's \((\S+)x with sequence parallelism\)",
     lambda: [ratio("tp", a, b) for a, b in TP]),
    ("tp-memory", r"memory rose by (\d+)-(\d+) MiB against tp=1's (\d+)\.", _tp_mib),
    ("1f1b-idle", r"\(1F1B: (\S+), (\S+), (\S+) against (\S+), (\S+), (\S+) at m = 1, 4, 8\)",
     lambda: _pp("1f1b", "ours_value") + _pp("1f1b", "ref_value")),
    ("gpipe-idle", r"GPipe's stops falling past m = 4 \((\S+), (\S+), (\S+)\)", lambda: _pp("gpipe", "ours_value")),
    ("pp-memory", r"GPipe's stage 0 grows with m \((\d+), (\d+), (\d+) MiB at m = 1, 4, 8\), 1F1B's stays lower "
     r"\((\d+), (\d+), (\d+)\)", lambda: _pp("gpipe", "ours_mib") + _pp("1f1b", "ours_mib")),
    ("scaling-2", r"dp=2 gives (\S+)x on 2 cores, pp=2 (\S+)x \(.*?\), tp=2 (\S+)x \(",
     lambda: [ratio("scaling", name, "1 process") for name in ("dp=2", "pp=2", "tp=2")]),
    ("scaling-4", r"\(dp=4 (\S+)x, pp=4 (\S+)x, tp=4 (\S+)x\)",
     lambda: [ratio("scaling", f"{k}=4 (oversubscribed)", "1 process") for k in ("dp", "pp", "tp")]),
    ("scaling-memory", r"peak resident set is (\d+)-(\d+) MiB \(one process: (\d+)\)", _scaling_mib),
]


@pytest.mark.parametrize("name,pattern,expected", CLAIMS, ids=[c[0] for c in CLAIMS])
def test_benchmark_prose_quotes_the_table(name: str, pattern: str, expected: Callable[[], list[str]]) -> None:
    found = re.findall(pattern, PROSE)
    assert len(found) == 1, f"the prose should say this once: {pattern}"
    quoted = [found[0]] if isinstance(found[0], str) else list(found[0])
    assert quoted == expected()


def test_benchmark_prose_shapes_match_the_table() -> None:
    """The claims in words: what is faster, what falls, what sits above."""
    assert all(TABLE["dp", f"ours-zero{z}", f"ds-zero{z}"].ratio < 1 for z in (1, 2, 3))  # "faster than DeepSpeed's"
    assert all(TABLE["pp", f"{k} m={m}", "(p-1)/(m+p-1)"].ratio > 1 for k, m in PP)  # "sits above ... at every m"
    one_f = [float(x) for x in _pp("1f1b", "ours_value")]
    gpipe = [float(x) for x in _pp("gpipe", "ours_value")]
    assert one_f == sorted(one_f, reverse=True) and gpipe[2] > gpipe[1]  # 1F1B falls; GPipe's stops past m=4
    assert all(int(a) > int(b) for a, b in zip(_pp("gpipe", "ours_mib")[1:], _pp("1f1b", "ours_mib")[1:]))
    lo, hi = map(float, re.search(r"\((\S+)-(\S+) over this day's runs\)", PROSE).groups())  # type: ignore[union-attr]
    assert lo <= TABLE["model", "GPT tiny", "HF GPT2 (sdpa)"].ratio <= hi
    date, seconds = re.search(r"\| (\d{4}-\d\d-\d\d) \| (\d+) s$", TITLE).groups()  # type: ignore[union-attr]
    assert f"Run on {date} " in BENCHMARKS and f"gloo; {seconds} s." in BENCHMARKS


def test_readme_quotes_no_test_count() -> None:
    readme = " ".join((REPO / "README.md").read_text().split())
    counts = re.findall(r"\b\d[\d,]*\+? (?:[a-z-]+ )?tests?\b", readme, flags=re.IGNORECASE)
    assert counts == [], f"README quotes a test count ({counts[0]!r}): say 'the suite' instead"


def test_the_layout_product_the_docs_state_is_the_one_the_code_checks() -> None:
    """world = dp * cp * tp * pp (context_parallel is a mesh dim of its own); the dp docstring and the README had
    left cp out, from before it existed."""
    from dist_llm.config import describe_keys
    from dist_llm.parallel.context import resolve_degrees

    assert resolve_degrees(16, 0, 2, 2, cp=2) == (2, 2, 2)  # dp = WORLD_SIZE / (cp * tp * pp)
    about = {key: text for key, _, text in describe_keys()}
    assert about["parallel.dp"] == "Data-parallel degree; 0 means WORLD_SIZE / (cp * tp * pp)."
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "it checks `dp * cp * tp * pp == WORLD_SIZE`" in readme
    assert "`dp * tp * pp" not in readme and '("dp", "pp", "tp")' not in readme
