"""scripts/pp_stats.py, bench_pp's issue-20 statistics, against hand-computed cases and independent formulas
(closed forms of the t quantile, published t tables, the paired t-test that defines Fieller's interval). Pure
Python: no processes."""

from __future__ import annotations

import math
import statistics
from typing import Any

import pytest

from scripts import pp_stats
from scripts.pp_stats import RatioCI, fieller, mean_ci, pairs_for, t_quantile, verdict


def test_t_quantile_against_closed_forms_and_tables() -> None:
    # df 1 (Cauchy): P(|T| <= t) = 2 atan(t) / pi, so t = tan(0.95 pi / 2); df 2: A = t / sqrt(2 + t^2), so
    # t = A sqrt(2 / (1 - A^2)). Bisection runs to float precision: 1e-9 is rounding, not method.
    assert t_quantile(1) == pytest.approx(math.tan(0.95 * math.pi / 2), rel=1e-9)
    assert t_quantile(2) == pytest.approx(0.95 * math.sqrt(2 / (1 - 0.95**2)), rel=1e-9)
    # published two-sided 95% values (7 significant digits); df 500 goes through the Cornish-Fisher branch
    for df, table in ((3, 3.182446), (4, 2.776445), (9, 2.262157), (30, 2.042272), (500, 1.964720)):
        assert t_quantile(df) == pytest.approx(table, abs=1e-6), df
    assert t_quantile(4, 0.99) == pytest.approx(4.604095, abs=1e-6)


def test_mean_ci_by_hand() -> None:
    # 1..5: mean 3, sd sqrt(2.5), standard error sqrt(0.5); t(4) 2.776445 -> half-width 1.963243
    mean, lo, hi = mean_ci([1.0, 2.0, 3.0, 4.0, 5.0])
    assert mean == 3.0
    assert (lo, hi) == (pytest.approx(1.036757, abs=1e-6), pytest.approx(4.963243, abs=1e-6))
    with pytest.raises(ValueError, match="at least 2 values, got 1"):
        mean_ci([1.0])


def test_fieller_by_hand_and_by_the_paired_t_test() -> None:
    # a = 2 4 3 5, b = 1 2 2 3: means 3.5 and 2, var(a) 5/3, var(b) 2/3, cov 1; t(3)^2 / 4 = 2.531991, so
    # A = 4 - 2.531991 * 2/3 = 2.312006, B = 7 - 2.531991 = 4.468009, C = 12.25 - 2.531991 * 5/3 = 8.030015,
    # roots (B -+ sqrt(B^2 - A C)) / A = 1.4212, 2.4439 (by hand to 4 places)
    a, b = [2.0, 4.0, 3.0, 5.0], [1.0, 2.0, 2.0, 3.0]
    ci = fieller(a, b)
    assert (ci.form, ci.ratio) == ("interval", 1.75)
    assert (ci.lo, ci.hi) == (pytest.approx(1.4212, abs=1e-4), pytest.approx(2.4439, abs=1e-4))
    # what defines it: at each end the paired t statistic of a_i - r b_i is exactly the 95% quantile
    for r in (ci.lo, ci.hi):
        d = [x - r * y for x, y in zip(a, b)]
        assert abs(statistics.fmean(d)) / (statistics.stdev(d) / 2) == pytest.approx(3.182446, abs=1e-6)


def test_fieller_with_a_constant_prediction_is_the_scaled_t_interval() -> None:
    a = [0.05, 0.02, 0.07, 0.04, 0.03]
    mean, lo, hi = mean_ci(a)
    for p in (0.04, -0.04):
        ci = fieller(a, [p] * len(a))
        assert ci.form == "interval" and ci.ratio == pytest.approx(mean / p, rel=1e-12)
        assert sorted((ci.lo, ci.hi)) == [pytest.approx(x, rel=1e-9) for x in sorted((lo / p, hi / p))]


def test_fieller_unbounded_sets() -> None:
    # the prediction indistinguishable from 0 while the margin is clearly 1: the ratios near 1 are rejected (the
    # test of a_i - r b_i at r = 1 has mean ~1 and spread ~0.1), only large |r| are not: two rays
    a, b = [1.0, 1.1, 0.9, 1.0, 1.05], [0.1, -0.1, 0.05, -0.05, 0.02]
    ci = fieller(a, b)
    assert ci.form == "outside" and ci.lo < 0.8 and ci.hi > 1.2 and verdict(ci) == "not met"

    def t_stat(r: float) -> float:
        d = [x - r * y for x, y in zip(a, b)]
        return abs(statistics.fmean(d)) / (statistics.stdev(d) / math.sqrt(len(d)))

    assert t_stat(1.0) > 2.776445 and t_stat(ci.lo) == pytest.approx(2.776445, abs=1e-6)
    assert t_stat(ci.hi) == pytest.approx(2.776445, abs=1e-6) and t_stat(10 * ci.hi) < 2.776445
    # both noise about zero: no ratio is rejected
    ci = fieller([0.01, -0.02, 0.015, -0.01], [-0.01, 0.02, 0.01, -0.015])
    assert ci.form == "all" and verdict(ci) == "undecided"
    with pytest.raises(ValueError, match="at least 2 pairs"):
        fieller([1.0], [1.0])


def test_fieller_against_a_prediction_of_exactly_zero() -> None:
    """b all 0 (a means-based margin rounded to 0): the quadratic's A and B vanish, and (mean(a) - r 0)^2 <= t^2
    var(a) / n holds for no r when the margin is clearly away from zero (0.025 +- 0.001: t = 0.025 / (0.001 /
    sqrt(4)) = 50 > 3.18), for every r when it is not."""
    ci = fieller([0.024, 0.026, 0.025, 0.025], [0.0] * 4)
    assert ci.form == "empty" and ci.text() == "none" and verdict(ci) == "not met"
    ci = fieller([0.01, -0.01, 0.005, -0.004], [0.0] * 4)
    assert ci.form == "all" and verdict(ci) == "undecided"


@pytest.mark.parametrize(("ci", "expected"), [
    (RatioCI(1.0, 0.85, 1.1, "interval"), "met"),
    (RatioCI(1.0, 0.8, 1.2, "interval"), "met"),  # (the ends count as inside)
    (RatioCI(1.5, 1.25, 2.0, "interval"), "not met"),
    (RatioCI(0.4, -0.1, 0.79, "interval"), "not met"),
    (RatioCI(0.9, 0.7, 1.0, "interval"), "undecided"),
    (RatioCI(1.0, 0.5, 1.5, "interval"), "undecided"),
    (RatioCI(9.0, 0.5, 1.5, "outside"), "not met"),
    (RatioCI(9.0, 0.9, 1.5, "outside"), "undecided"),
    (RatioCI(math.nan, math.nan, math.nan, "all"), "undecided"),
    (RatioCI(math.nan, math.nan, math.nan, "empty"), "not met"),
    (RatioCI(9.0, -math.inf, 1.5, "outside"), "not met"),  # one ray, [1.5, inf): clear of [0.8, 1.2]
    (RatioCI(9.0, -math.inf, 1.0, "outside"), "undecided"),  # [1.0, inf)
    (RatioCI(0.1, 0.5, math.inf, "outside"), "not met"),  # (-inf, 0.5]
])
def test_verdict(ci: RatioCI, expected: str) -> None:
    assert verdict(ci) == expected


def test_pairs_for_by_hand() -> None:
    # a = 0.9, 1.1 against a constant 1: ratio 1, sd sqrt(0.02); half-width 0.1 needs t(n-1) sqrt(2) <= sqrt(n):
    # n = 10: (2.262157 sqrt 2)^2 = 10.23 > 10; n = 11: (2.228139 sqrt 2)^2 = 9.93 <= 11
    assert pairs_for([0.9, 1.1], [1.0, 1.0], 0.1) == 11
    assert pairs_for([0.9, 1.1], [0.0, 0.0], 0.1) is None  # (no ratio)
    assert pairs_for([0.9, 1.1], [1.0, 1.0], 1e-5) is None  # (past the cap)


def _row(schedule: str, steps: list[list[float]], replayed: list[list[float]]) -> dict[str, Any]:
    mean = [statistics.fmean(s[i] for s in steps) for i in range(2)]
    return {"schedule": schedule, "m": 4, "v": 1, "idle_fraction_steps": steps, "replayed_steps": replayed,
            "idle_fraction": mean, "measured_prediction": [0.2, 0.2] if schedule == "1f1b" else [0.16, 0.16],
            "predicted_idle_fraction": [0.2, 0.2] if schedule == "1f1b" else [0.15, 0.15], "step_s": 0.5}


def test_margin_stats_pairs_step_i_with_step_i() -> None:
    """Margins are 1F1B's step i minus the schedule's step i (mean of the stages): 0.05, 0.06, 0.04 here; unpaired
    (each side's steps shuffled) they would not be."""
    base = _row("1f1b", [[0.25, 0.21], [0.27, 0.23], [0.22, 0.20]], [[0.24, 0.22], [0.26, 0.24], [0.21, 0.21]])
    zb1 = _row("zb1", [[0.19, 0.17], [0.20, 0.18], [0.18, 0.16]], [[0.20, 0.16], [0.21, 0.17], [0.17, 0.17]])
    (e,) = pp_stats.margin_stats([base, _row("gpipe", base["idle_fraction_steps"], base["replayed_steps"]), zb1])
    assert (e["schedule"], e["pairs"]) == ("zb1", 3)
    got, replayed = [0.05, 0.06, 0.04], [0.05, 0.06, 0.04]  # (replayed: 0.23-0.18, 0.25-0.19, 0.21-0.17)
    assert e["margin"] == pytest.approx(mean_ci(got), abs=1e-12)
    assert e["replayed"] == pytest.approx(mean_ci(replayed), abs=1e-12)
    # measured equal to replayed pair by pair: the ratio is 1 with no spread at all, so met (the interval is 1 up
    # to the square root of the rounding in the per-step differences, ~1e-8)
    assert e["ratio_replayed"].form == "interval" and e["ratio_replayed"].lo == pytest.approx(1.0, abs=1e-6)
    assert e["ratio_replayed"].hi == pytest.approx(1.0, abs=1e-6) and e["verdict"] == "met"
    assert e["predicted"] == pytest.approx(0.04) and e["ratio_predicted"].ratio == pytest.approx(0.05 / 0.04)
    assert e["units"] == pytest.approx(0.05) and e["round_s"] == 1.5
    # --predict units: against the constant 0.05, the margin's own spread decides: 1 +- 4.303 * 0.01 / sqrt(3)
    # / 0.05 = [0.50, 1.50], undecided
    (u,) = pp_stats.margin_stats([base, zb1], "units")
    assert u["verdict"] == "undecided" and u["ratio_units"].lo == pytest.approx(1 - 4.302653 * 0.2 / math.sqrt(3))
    assert pp_stats.undecided([base, zb1], "units") == ["zb1 m=4"]
    assert "met" in pp_stats.margins_table([base, zb1], [4], "measured")


def test_until_decided_stops_on_99_percent_and_ten_pairs() -> None:
    """Margins 0.05 +- 0.0114 (sd 0.01202) over 10 pairs against a constant 0.05 (--predict units): the ratio's
    half-width is 2.262 * 0.01202 / sqrt(10) / 0.05 = 0.172 at 95% (met), 3.250 * ... = 0.247 at 99% (not yet)."""
    got = [0.05 + (0.0114 if i % 2 else -0.0114) for i in range(10)]
    base = _row("1f1b", [[0.2, 0.2]] * 10, [[0.2, 0.2]] * 10)
    zb1 = _row("zb1", [[0.2 - g, 0.2 - g] for g in got], [[0.2 - g, 0.2 - g] for g in got])
    (e,) = pp_stats.margin_stats([base, zb1], "units")
    ci = e["ratio_units"]
    assert e["verdict"] == "met" and ci.hi - 1 == pytest.approx(2.262157 * statistics.stdev(got) / math.sqrt(10) / 0.05)
    assert pp_stats.undecided([base, zb1], "units") == ["zb1 m=4"]
    assert pp_stats.undecided([base, zb1], "units", level=0.95) == []
    # 9 pairs of half that spread: decided even at 99%, but fewer than MIN_PAIRS: not done
    got = [0.05, *([0.045, 0.055] * 4)]
    short = [_row("1f1b", [[0.2, 0.2]] * 9, [[0.2, 0.2]] * 9),
             _row("zb1", [[0.2 - g, 0.2 - g] for g in got], [[0.2 - g, 0.2 - g] for g in got])]
    assert pp_stats.margin_stats(short, "units", level=0.99)[0]["verdict"] == "met"
    assert pp_stats.undecided(short, "units") == ["zb1 m=4"]
    # what bench_pp prints after --until-decided: the verdict at 99% and MIN_PAIRS pairs, so a budget that ran out
    # on the 10 pairs above prints "undecided", not 95%'s "met"
    (e,) = pp_stats.margin_stats([base, zb1], "units", pp_stats.STOP_LEVEL, pp_stats.MIN_PAIRS)
    assert e["verdict"] == "undecided" and e["level"] == 0.99
    # one pair: no interval at all, still the level it was asked at
    (e,) = pp_stats.margin_stats([_row("1f1b", [[0.2, 0.2]], [[0.2, 0.2]]), _row("zb1", [[0.1, 0.1]], [[0.1, 0.1]])],
                                 "units", pp_stats.STOP_LEVEL, pp_stats.MIN_PAIRS)
    assert e["verdict"] == "undecided" and e["level"] == 0.99 and e["pairs"] == 1 and "margin" not in e
    table = pp_stats.margins_table([base, zb1], [4], "units", pp_stats.STOP_LEVEL, pp_stats.MIN_PAIRS)
    assert "ratio [99% Fieller]" in table and "undecided" in table and "95%" not in table
