"""Pipeline schedules and stage partitioning: pure logic, no processes."""

from __future__ import annotations

import pytest

from dist_llm.config import ConfigError
from dist_llm.parallel.pipeline.schedule import (
    SCHEDULES,
    Action,
    bubble_fraction,
    gpipe,
    one_f_one_b,
    peak_in_flight,
    simulate,
)
from dist_llm.parallel.pipeline.stage import partition_layers

SHAPES = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 4, 5, 8, 16)]


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize(("stages", "micro"), SHAPES)
def test_every_micro_batch_once_forward_before_backward(name: str, stages: int, micro: int) -> None:
    plans = SCHEDULES[name](stages, micro)
    assert len(plans) == stages
    for s, plan in enumerate(plans):
        for kind in ("F", "B"):
            assert sorted(a.micro for a in plan if a.kind == kind) == list(range(micro))
        for m in range(micro):
            assert plan.index(Action("F", m)) < plan.index(Action("B", m))
        # first stage never receives activations, last stage never sends them
        assert (s == 0) == (not any(a.kind == "RECV_F" for a in plan))
        assert (s == stages - 1) == (not any(a.kind == "SEND_F" for a in plan))


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize(("stages", "micro"), SHAPES)
def test_no_deadlock_and_the_bubble_formula(name: str, stages: int, micro: int) -> None:
    """With equal stages (backward twice a forward) the idle share of each stage is (p-1)/(m+p-1)."""
    makespan, busy = simulate(SCHEDULES[name](stages, micro))
    assert makespan == pytest.approx(3 * (micro + stages - 1))
    for b in busy:
        assert 1 - b / makespan == pytest.approx(bubble_fraction(stages, micro))


@pytest.mark.parametrize(("stages", "micro"), SHAPES)
def test_activation_memory(stages: int, micro: int) -> None:
    """GPipe holds all m micro-batches on every stage; 1F1B at most p - s on stage s."""
    for s, plan in enumerate(gpipe(stages, micro)):
        assert peak_in_flight(plan) == micro
    for s, plan in enumerate(one_f_one_b(stages, micro)):
        assert peak_in_flight(plan) == min(stages - s, micro)


def test_one_f_one_b_order_on_two_stages() -> None:
    first, last = one_f_one_b(2, 3)
    assert [a for a in first if a.kind in ("F", "B")] == [Action("F", 0), Action("F", 1), Action("B", 0),
                                                         Action("F", 2), Action("B", 1), Action("B", 2)]
    assert [a for a in last if a.kind in ("F", "B")] == [Action("F", 0), Action("B", 0), Action("F", 1),
                                                        Action("B", 1), Action("F", 2), Action("B", 2)]


def test_a_broken_schedule_is_caught() -> None:
    plans = gpipe(2, 2)
    plans[1] = [Action("RECV_F", 1), *[a for a in plans[1] if a != Action("RECV_F", 1)]]  # waits for m=1 first
    plans[0] = [a for a in plans[0] if a != Action("SEND_F", 1)]  # ...which never comes
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(plans)


def test_partition_balances_parameters() -> None:
    assert [len(r) for r in partition_layers(8, 2)] == [4, 4]
    assert [len(r) for r in partition_layers(7, 2)] == [4, 3]  # uneven counts
    # a heavy embedding on the first stage and a heavy head on the last push blocks to the middle
    assert [len(r) for r in partition_layers(8, 4, first_extra=1.5, last_extra=1.5)] == [1, 3, 3, 1]
    ranges = partition_layers(10, 3)
    assert ranges[0].start == 0 and ranges[-1].stop == 10
    assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))
    assert [len(r) for r in partition_layers(6, 3, explicit=[1, 2, 3])] == [1, 2, 3]


@pytest.mark.parametrize(("args", "message"), [
    ((2, 4), "parallel.pp: 4 stages need at least as many blocks, model.n_layer=2"),
    ((6, 2, [2, 2]), "parallel.pp_layers: [2, 2] must be 2 positive counts summing to model.n_layer=6"),
    ((6, 3, [3, 3, 0]), "parallel.pp_layers: [3, 3, 0] must be 3 positive counts"),
])
def test_partition_errors_name_the_key(args: tuple, message: str) -> None:
    n, p, *explicit = args
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        partition_layers(n, p, explicit=explicit[0] if explicit else None)
