"""conftest.made_once: a fixture made once for every xdist worker, and a failed try leaves nothing behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import made_once


def test_a_failed_make_leaves_nothing_and_the_next_try_starts_empty(pytestconfig: pytest.Config,
                                                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    name = f"selftest-{id(object())}"  # (a name no other test of the session uses)

    def broken(folder: Path) -> int:
        (folder / "half.ckpt").write_text("left by a crash")
        raise RuntimeError("make failed")

    with pytest.raises(RuntimeError, match="make failed"):
        made_once(pytestconfig, tmp_path_factory, name, broken)
    seen: list[list[str]] = []

    def good(folder: Path) -> dict[str, int]:
        seen.append(sorted(p.name for p in folder.iterdir()))
        return {"made": 1}

    assert made_once(pytestconfig, tmp_path_factory, name, good) == {"made": 1}
    assert seen == [[]]  # the broken try's file was gone
    assert made_once(pytestconfig, tmp_path_factory, name, good) == {"made": 1}
    assert len(seen) == 1  # made once: the second call read the result
