"""Pipeline schedules and stage partitioning: pure logic, no processes."""

from __future__ import annotations

import pytest
import torch

from dist_llm.config import ConfigError, load_config, overlap_p2p
from dist_llm.model import GPT
from dist_llm.parallel.pipeline.schedule import (
    SCHEDULES,
    Action,
    Exchange,
    bubble_fraction,
    build_plans,
    forward_only,
    gpipe,
    interleaved,
    one_f_one_b,
    peak_in_flight,
    peak_pending_weights,
    simulate,
    zb1,
)
from dist_llm.parallel.pipeline.stage import block_params, describe_stages, partition_layers, stage_ranges
from scripts import bench_pp

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
        if name == "zb1":  # the backward split: each weight-gradient half once, after its input-gradient half
            assert sorted(a.micro for a in plan if a.kind == "W") == list(range(micro))
            assert all(plan.index(Action("B", m)) < plan.index(Action("W", m)) for m in range(micro))
        else:
            assert not any(a.kind == "W" for a in plan)
        # first stage never receives activations, last stage never sends them
        assert (s == 0) == (not any(a.kind == "RECV_F" for a in plan))
        assert (s == stages - 1) == (not any(a.kind == "SEND_F" for a in plan))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "forward"])
@pytest.mark.parametrize(("stages", "micro"), SHAPES)
def test_no_deadlock_and_the_bubble_formula(name: str, stages: int, micro: int) -> None:
    """The executor's plans (exchanges) under rendezvous semantics: no deadlock, and with equal stages (backward
    twice a forward) the idle share of each stage is (p-1)/(m+p-1), as if sends were free of waiting."""
    makespan, busy = simulate(build_plans(name, stages, micro))
    assert makespan == pytest.approx((1 if name == "forward" else 3) * (micro + stages - 1))
    for b in busy:
        assert 1 - b / makespan == pytest.approx(bubble_fraction(stages, micro))


@pytest.mark.parametrize("name", [*SCHEDULES, "forward"])
@pytest.mark.parametrize(("stages", "micro"), SHAPES)
def test_each_exchange_is_one_send_and_receive_with_one_neighbour(name: str, stages: int, micro: int) -> None:
    plans = build_plans(name, stages, micro)
    make = forward_only if name == "forward" else SCHEDULES[name]
    for s, (steps, actions) in enumerate(zip(plans, make(stages, micro), strict=True)):
        flat = [a for x in steps for a in (x.ops if isinstance(x, Exchange) else (x,))]
        assert flat == actions  # grouping keeps the order of the schedule
        for x in steps:
            if isinstance(x, Exchange):
                kinds = sorted(a.kind for a in x.ops)
                # with the next stage: send an activation, receive a gradient; with the previous: the reverse
                assert kinds in (["SEND_F"], ["RECV_B"], ["RECV_B", "SEND_F"],
                                 ["RECV_F"], ["SEND_B"], ["RECV_F", "SEND_B"]), (s, x)


@pytest.mark.parametrize(("stages", "micro"), [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 5, 8, 16, 32)])
def test_zb1_bubble(stages: int, micro: int) -> None:
    """ZB-H1 with F = B = W (a whole backward 2 forwards, as for the others): the exchanges run free of deadlock,
    the W's take the weight half of the backward out of the bubble, so a step lasts 3m + 2(p-1) forwards (one
    less at m = p) against 1F1B's 3m + 3(p-1), and no stage holds more micro-batches than 1F1B's first."""
    makespan, busy = simulate(build_plans("zb1", stages, micro))
    assert makespan == 3 * micro + 2 * (stages - 1) - (1 if micro == stages > 1 else 0)
    assert busy == [3.0 * micro] * stages  # every stage's F, B and W of every micro-batch
    if micro != stages:
        for b in busy:
            assert 1 - b / makespan == pytest.approx(bubble_fraction(stages, micro, schedule="zb1"))
    assert makespan <= simulate(build_plans("1f1b", stages, micro))[0]
    assert max(peak_in_flight(plan) for plan in zb1(stages, micro)) == min(stages, micro)


INTERLEAVED = [(p, v, m) for p in (2, 3, 4) for v in (2, 3, 4) for m in (p, 2 * p, 4 * p, 8 * p)]


@pytest.mark.parametrize(("stages", "chunks", "micro"), INTERLEAVED)
def test_interleaved_bubble(stages: int, chunks: int, micro: int) -> None:
    """Interleaved 1F1B with each chunk 1/v of a stage (a chunk's forward 1/v, its backward 2/v): no deadlock round
    the ring, every (micro-batch, chunk) forward then backward once per rank, and every rank idle
    (p-1)/(v*m + p-1) of the step, v times less than 1F1B's bubble at the same m."""
    plans = interleaved(stages, micro, chunks)
    for plan in plans:
        for kind in ("F", "B"):
            assert sorted((a.micro, a.chunk) for a in plan if a.kind == kind) == [
                (m, c) for m in range(micro) for c in range(chunks)]
    makespan, busy = simulate(build_plans("interleaved", stages, micro, chunks),
                              forward_cost=1 / chunks, backward_cost=2 / chunks)
    assert makespan == pytest.approx(3 * micro + 3 * (stages - 1) / chunks)
    for b in busy:
        assert 1 - b / makespan == pytest.approx(bubble_fraction(stages, micro, chunks=chunks))
        assert 1 - b / makespan < bubble_fraction(stages, micro)
    # evaluation: forwards only, round the ring chunk by chunk
    assert simulate(build_plans("forward", stages, micro, chunks), forward_cost=1 / chunks)[0] == pytest.approx(
        micro + (stages - 1) / chunks)


@pytest.mark.parametrize(("stages", "chunks", "micro"), INTERLEAVED)
def test_interleaved_with_overlap(stages: int, chunks: int, micro: int) -> None:
    """parallel.pp_overlap_p2p: the same computations in the same order, no deadlock with every rank's calls run
    one after another (NCCL's stream) and each waited for only where its receive is used, the same bubble with
    free exchanges, and with dear ones a shorter step: each steady-state exchange completes behind the next
    computation."""
    plain, overlapped = interleaved(stages, micro, chunks), interleaved(stages, micro, chunks, overlap=True)
    for a, b in zip(plain, overlapped, strict=True):
        assert [x for x in a if x.kind in ("F", "B")] == [x for x in b if x.kind in ("F", "B")]
        assert sorted(a, key=repr) == sorted(b, key=repr)
    plans = build_plans("interleaved", stages, micro, chunks, overlap=True)
    for plan in plans:  # each exchange carries one direction: activations or gradients
        assert all(len({a.kind[-1] for a in x.ops}) == 1 for x in plan if isinstance(x, Exchange))
    units = {"forward_cost": 1 / chunks, "backward_cost": 2 / chunks}
    makespan, _ = simulate(plans, overlap=True, **units)
    assert makespan == pytest.approx(3 * micro + 3 * (stages - 1) / chunks)
    dear = simulate(plans, overlap=True, exchange_cost=0.05, **units)[0]
    without = simulate(build_plans("interleaved", stages, micro, chunks), exchange_cost=0.05, **units)[0]
    assert dear < without if micro > stages else dear <= without


@pytest.mark.parametrize(("stages", "micro"), [(p, m) for p in (2, 3, 4, 8) for m in (1, 2, 3, 4, 5, 8, 16, 32)])
def test_zb1_with_overlap(stages: int, micro: int) -> None:
    """ZB-H1 with overlap: every stage but the first runs the W's it holds back after the exchange that follows its B
    (the input gradient's send, the next activation's receive), computing while that exchange waits for the
    neighbour. With F = B = W = 1 and m >= p a step is then 3m + (p-1), the paper's ideal bubble (p-1)(F+B-W),
    against 3m + 2(p-1) without overlap; never longer, the same peaks of held micro-batches and W states. 1F1B's
    and GPipe's steps are unchanged by overlap (each of their exchanges holds what the next computation needs, or
    sends only)."""
    plans = build_plans("zb1", stages, micro, overlap=True)
    makespan, busy = simulate(plans, overlap=True)
    waited = simulate(build_plans("zb1", stages, micro))[0]
    assert makespan <= waited
    if micro >= stages:
        assert makespan == 3 * micro + stages - 1
        assert waited == 3 * micro + 2 * (stages - 1) - (1 if micro == stages > 1 else 0)
    assert busy == [3.0 * micro] * stages
    for b in busy:
        assert 1 - b / makespan == pytest.approx(bubble_fraction(stages, micro, schedule="zb1", overlap=True))
    for plain, over in zip(zb1(stages, micro), zb1(stages, micro, overlap=True), strict=True):
        assert peak_in_flight(plain) == peak_in_flight(over)
        assert peak_pending_weights(plain) == peak_pending_weights(over)
    for name in ("1f1b", "gpipe"):
        assert simulate(build_plans(name, stages, micro), overlap=True) == simulate(build_plans(name, stages, micro))


def test_overlap_by_hand() -> None:
    """Stage 0 forwards two micro-batches and sends each; stage 1 posts both receives first, then forwards. F = 1,
    an exchange completes 0.5 after both sides started it. Without overlap stage 0 waits for each send (done at
    1.5, the second at 3.0) and stage 1 for each receive: F0 at 3.0-4.0 (its second receive, posted at 1.5, is
    started only once stage 0's second send is, at 2.5), F1 at 4.0-5.0. With overlap stage 0 forwards at 0-1 and
    1-2 without waiting; stage 1's stream runs the first receive at 0-1.5 and the second at 2-2.5 (stage 0's second
    send starts at 2): F0 at 1.5-2.5, F1 at 2.5-3.5."""
    s0, s1, r0, r1 = (Action("SEND_F", 0), Action("SEND_F", 1), Action("RECV_F", 0), Action("RECV_F", 1))
    plans = [[Action("F", 0), Exchange((s0,)), Action("F", 1), Exchange((s1,))],
             [Exchange((r0,)), Exchange((r1,)), Action("F", 0), Action("F", 1)]]
    assert simulate(plans, exchange_cost=0.5) == (5.0, [2.0, 2.0])
    trace: list[tuple[int, Action, float]] = []
    assert simulate(plans, exchange_cost=0.5, overlap=True, trace=trace) == (3.5, [2.0, 2.0])
    assert [(s, repr(a), t) for s, a, t in trace] == [(0, "F 0", 0.0), (0, "F 1", 1.0), (1, "F 0", 1.5),
                                                      (1, "F 1", 2.5)]
    # posting costs the stage its time (idle), here 0.25 each on stage 0: its sends count as posted at 1.25 and 2.5,
    # stage 1's first receive completes at 1.75, its second starts then and pairs at 2.5: F0 1.75-2.75, F1 3.0-4.0
    assert simulate(plans, exchange_cost=0.5, overlap=True, post_cost=[0.25, 0.0]) == (4.0, [2.0, 2.0])
    # one figure per exchange (a replay of a step's own posts): the second send posted at 2.25 + 0.5, F1 3.25-4.25
    assert simulate(plans, exchange_cost=0.5, overlap=True, post_cost=[[0.25, 0.5], 0.0]) == (4.25, [2.0, 2.0])
    # without overlap: stage 0 waits for its first send (1.75), forwards 1.75-2.75, posts its second by 3.0, which
    # pairs with the receive stage 1 posted at 1.75, done at 3.5: stage 1's forwards 3.5-4.5, 4.5-5.5
    assert simulate(plans, exchange_cost=0.5, post_cost=[0.25, 0.0]) == (5.5, [2.0, 2.0])


def test_overlap_keeps_each_ranks_calls_in_order() -> None:
    """Posted without waiting, a rank's calls still run one after another (a communicator's stream): 1F1B with each
    send and receive a call of its own deadlocks with overlap as without; and a computation placed before the
    receive of its input is refused."""
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(one_f_one_b(2, 4), overlap=True)
    broken = [[Action("F", 0), Exchange((Action("SEND_F", 0),))], [Action("F", 0), Exchange((Action("RECV_F", 0),))]]
    for overlap in (True, False):
        with pytest.raises(ValueError, match=r"stage 1: F 0 comes before the receive of its input"):
            simulate(broken, overlap=overlap)
    with pytest.raises(ValueError, match="stage 0's post costs are 2, its plan has 1 exchanges"):
        simulate(broken, post_cost=[[0.1, 0.2], 0.0])


def test_interleaved_with_overlap_on_two_stages() -> None:
    """Megatron's overlap_p2p_comm order, rank 0 of 2 x 2 chunks (virtual stages 0 and 2), 4 micro-batches: after
    each forward its activation's send with the next forward's receive (none for chunk 0, the first virtual
    stage), the last warm-up forward's call apart from the first backward's receive, and in the steady state each
    backward's gradient send with the next backward's receive right after it."""
    first = build_plans("interleaved", 2, 4, 2, overlap=True)[0]
    text = " ".join(repr(x) for x in first)
    assert text.startswith("F 0 {SEND_F 0} F 1 {SEND_F 1, RECV_F 0/1} F 0/1 {SEND_F 0/1, RECV_F 1/1} "
                           "F 1/1 {SEND_F 1/1} {RECV_B 0/1} F 2 {SEND_F 2} B 0/1 {SEND_B 0/1, RECV_B 1/1} "
                           "F 3 {SEND_F 3, RECV_F 2/1} B 1/1 {SEND_B 1/1, RECV_B 0} F 2/1"), text


def test_interleaved_order_on_two_stages() -> None:
    """2 ranks x 2 chunks, 4 micro-batches: rank 0 warms up with 2(p-1-r) + (v-1)p = 4 forwards (micro-batches 0
    and 1 through chunk 0, then through chunk 1), rank 1 with 2; the backwards start from the last chunk."""
    def acts(plan: list[Action]) -> list[str]:
        return [f"{a.kind}{a.micro}.{a.chunk}" for a in plan if a.kind in ("F", "B")]
    first, last = interleaved(2, 4, 2)
    assert acts(first) == ["F0.0", "F1.0", "F0.1", "F1.1", "F2.0", "B0.1", "F3.0", "B1.1", "F2.1", "B0.0",
                           "F3.1", "B1.0", "B2.1", "B3.1", "B2.0", "B3.0"]
    assert acts(last)[:4] == ["F0.0", "F1.0", "F0.1", "B0.1"]


@pytest.mark.parametrize(("stages", "micro"), [(2, 3), (4, 6), (3, 4)])
def test_interleaved_needs_micro_batches_a_multiple_of_stages(stages: int, micro: int) -> None:
    with pytest.raises(ValueError, match=f"{micro} micro-batches are not a multiple of {stages} stages"):
        interleaved(stages, micro, 2)


def test_zb1_order_on_two_stages() -> None:
    """The first stage runs each W right after its B; the last holds back one W and runs it after the exchange
    that follows its next B (so that exchange stays one, as the first stage posts it)."""
    first, last = build_plans("zb1", 2, 3)
    assert [a for a in first if isinstance(a, Action)] == [
        Action("F", 0), Action("F", 1), Action("B", 0), Action("W", 0), Action("F", 2), Action("B", 1),
        Action("W", 1), Action("B", 2), Action("W", 2)]
    assert [a for a in last if isinstance(a, Action)] == [
        Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1), Action("W", 0), Action("F", 2),
        Action("B", 2), Action("W", 1), Action("W", 2)]


@pytest.mark.parametrize(("stages", "micro"), [(p, m) for p, m in SHAPES if p > 1 and m > 1])
def test_one_action_per_batch_deadlocks_1f1b_under_rendezvous(stages: int, micro: int) -> None:
    """Each send and receive posted on its own, as the executor did before exchanges: in 1F1B's steady state
    stage s sends F then receives B while stage s+1 sends B then receives F, a circular wait on NCCL."""
    with pytest.raises(ValueError, match=r"deadlocks: stages wait on \{.*\{SEND_F \d+\}.*\{SEND_B \d+\}"):
        simulate(one_f_one_b(stages, micro))


def test_rendezvous_by_hand() -> None:
    send_f, recv_f, send_b, recv_b = (Action("SEND_F", 0), Action("RECV_F", 0), Action("SEND_B", 0),
                                      Action("RECV_B", 0))
    # each stage sends before it receives, the sends one by one: neither receive is ever posted
    with pytest.raises(ValueError, match="deadlocks"):
        simulate([[Exchange((send_f,)), Exchange((recv_b,))], [Exchange((send_b,)), Exchange((recv_f,))]])
    # the same actions posted together on each side: both messages go through
    assert simulate([[Exchange((send_f, recv_b))], [Exchange((send_b, recv_f))]]) == (0.0, [0.0, 0.0])
    # a send waits for its receive: stage 0 sends at t=1, stage 1 receives at t=2 (after its backward), so
    # stage 0's second forward runs from 2 to 3; with buffered sends it would end at 2
    assert simulate([[Action("F", 0), Exchange((send_f,)), Action("F", 1)],
                     [Action("B", 5), Exchange((recv_f,))]]) == (3.0, [2.0, 2.0])


def test_messages_pair_in_the_order_posted() -> None:
    """NCCL has no tags: the first receive from a stage gets that stage's first send, whatever micro-batch."""
    with pytest.raises(ValueError, match="stage 1's RECV_F 1 would receive stage 0's SEND_F 0"):
        simulate([[Exchange((Action("SEND_F", 0),)), Exchange((Action("SEND_F", 1),))],
                  [Exchange((Action("RECV_F", 1),)), Exchange((Action("RECV_F", 0),))]])


def test_simulate_with_measured_costs() -> None:
    """The bench's prediction: per-stage cost tables (seconds measured per action), a latency per exchange, and a
    replay of single actions' durations. GPipe p=2 m=1 by hand: F0 on stage 0, the activation's trip, F0 and B0
    on stage 1, the gradient's trip, B0 on stage 0."""
    plans = build_plans("gpipe", 2, 1)
    units = [{"F": 1.0, "B": 2.0}] * 2
    assert simulate(plans, costs=units) == simulate(plans)
    assert simulate(plans, costs=[{"F": 1.0, "B": 3.0}, {"F": 2.0, "B": 4.0}], exchange_cost=0.5) == (
        1 + 0.5 + 2 + 4 + 0.5 + 3, [4.0, 6.0])
    # one action of its own (a replay): stage 1's B of micro-batch 0 took 5
    assert simulate(plans, costs=[units[0], {**units[1], ("B", 0): 5.0}])[0] == 1 + 1 + 5 + 2
    # interleaved: chunk 1's actions from "F1"/"B1" where given, else the plain kind's
    plans = build_plans("interleaved", 2, 2, 2)
    even = simulate(plans, costs=[{"F": 0.5, "B": 1.0}] * 2)
    assert even == simulate(plans, forward_cost=0.5, backward_cost=1.0)
    assert simulate(plans, costs=[{"F": 0.5, "B": 1.0, "F1": 1.5}] * 2)[1] == [b + 2 * 1.0 for b in even[1]]
    with pytest.raises(ValueError, match="1 cost tables for 2 stages"):
        simulate(build_plans("1f1b", 2, 2), costs=units[:1])
    with pytest.raises(ValueError, match=r"stage 0's cost table has no W \(its plan has B, F, W actions\)"):
        simulate(build_plans("zb1", 2, 2), costs=units)  # (a KeyError from deep inside, before)


def test_simulate_with_a_cost_per_exchange_size() -> None:
    """An exchange costs what one of its size costs (bench_pp measures them: more messages, more transfers and
    wake-ups). 1F1B p=2 m=2 by hand, F 1 and B 2: stage 0 F0, {SEND_F 0} (1 message), F1, then {SEND_F 1, RECV_B 0}
    (2) waits for stage 1's F0 and B0; B0, {RECV_B 1} (1) waits for stage 1's F1 and B1; B1: 9 + 2 c1 + c2."""
    plans = build_plans("1f1b", 2, 2)
    assert simulate(plans)[0] == 9.0
    assert simulate(plans, exchange_cost={1: 0.5, 2: 1.5})[0] == 9 + 2 * 0.5 + 1.5
    # a size without an entry costs the nearest below (a float is every size's cost), else the nearest above
    assert simulate(plans, exchange_cost={1: 0.5})[0] == simulate(plans, exchange_cost=0.5)[0] == 9 + 3 * 0.5
    assert simulate(plans, exchange_cost={2: 1.5})[0] == 9 + 3 * 1.5


def test_bench_measures_what_an_exchange_costs_beyond_the_rendezvous() -> None:
    """bench_pp's exchange cost: each exchange's end minus the later of its own post and the posts of the other
    sides of its messages (paired in order per direction). GPipe p=2 m=1 timed by hand: stage 0 posts {SEND_F 0,
    RECV_B 0} at 1.0, done at 5.2; stage 1 waits for F0 from 0.0 to 1.3, and sends B0 at 5.0, done at 5.2. Stage 0's
    exchange was ready at 5.0 (stage 1's send), stage 1's receive at 1.0 (stage 0's post)."""
    plans = build_plans("gpipe", 2, 1)
    got = bench_pp.exchange_excess(plans, [[(1.0, 5.2)], [(0.0, 1.3), (5.0, 5.2)]])
    assert got.keys() == {1, 2} and got[2] == pytest.approx([0.2]) and got[1] == pytest.approx([0.3, 0.2])
    with pytest.raises(RuntimeError, match="stage 1: 1 exchanges timed, its plan has 2"):
        bench_pp.exchange_excess(plans, [[(1.0, 5.2)], [(0.0, 1.3)]])
    # with each exchange's posting timed, an exchange counts as posted when its posting ended: stage 0's posting
    # ended at 1.1, stage 1's at 0.05 and 5.15. Stage 0's exchange ready at 5.15, stage 1's receive at 1.1, its send
    # at 5.15
    got = bench_pp.exchange_excess(plans, [[(1.0, 5.2)], [(0.0, 1.3), (5.0, 5.2)]],
                                   [[(1.0, 1.1)], [(0.0, 0.05), (5.0, 5.15)]])
    assert got[2] == pytest.approx([0.05]) and got[1] == pytest.approx([0.2, 0.05])


def test_bench_charges_exchanges_1f1bs_cost_per_message() -> None:
    """--exchange-cost fitted: 1F1B's exchanges of one message took 1 and 3 ms, its one of two 4 ms: 8 ms over 4
    messages, 2 ms a message, so interleaved's exchanges of 1 to 4 messages are charged 2, 4, 6 and 8 ms whatever
    its own took; measured charges each size its own mean; latency the ping-pong's for every size."""
    per = bench_pp.cost_per_message({1: [0.001, 0.003], 2: [0.004]})
    assert per == pytest.approx(0.002)
    mine = {1: [0.005], 2: [0.001, 0.002], 3: [0.0], 4: [0.009]}
    charged = bench_pp.exchange_charge("fitted", mine, per_message=per, latency=0.3)
    assert charged == pytest.approx({1: 0.002, 2: 0.004, 3: 0.006, 4: 0.008})
    assert bench_pp.exchange_charge("measured", mine, per_message=per, latency=0.3) == pytest.approx(
        {1: 0.005, 2: 0.0015, 3: 0.0, 4: 0.009})
    assert bench_pp.exchange_charge("latency", mine, per_message=per, latency=0.3) == {1: 0.3, 2: 0.3, 3: 0.3, 4: 0.3}
    # excesses counted from the postings' ends can average below zero (a transfer done before the sender's call
    # returned): charged nothing, not a negative time
    assert bench_pp.exchange_charge("fitted", mine, per_message=-0.0001, latency=0.3) == {1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0}
    assert bench_pp.exchange_charge("measured", {1: [-0.001, 0.0005]}, per_message=None, latency=0.3) == {1: 0.0}
    with pytest.raises(ValueError, match="fitted needs 1F1B's cost per message"):  # (not the latency, silently)
        bench_pp.exchange_charge("fitted", mine, per_message=None, latency=0.3)


def test_bench_refuses_fitted_exchange_costs_without_1f1b(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        bench_pp.parse_args(["--schedules", "gpipe", "zb1"])
    assert stop.value.code == 2
    assert "--exchange-cost fitted charges 1F1B's cost per message: put 1f1b in --schedules" in capsys.readouterr().err
    assert bench_pp.parse_args(["--schedules", "gpipe", "zb1", "--exchange-cost", "measured"]).exchange_cost == "measured"


@pytest.mark.parametrize(("stages", "micro"), SHAPES)
def test_activation_memory(stages: int, micro: int) -> None:
    """GPipe holds all m micro-batches on every stage; 1F1B at most p - s on stage s."""
    for s, plan in enumerate(gpipe(stages, micro)):
        assert peak_in_flight(plan) == micro
    for s, plan in enumerate(one_f_one_b(stages, micro)):
        assert peak_in_flight(plan) == min(stages - s, micro)
    for s, plan in enumerate(zb1(stages, micro)):  # a held-back W keeps its micro-batch's activations
        assert peak_in_flight(plan) == min(stages, micro)


@pytest.mark.parametrize("stages", range(2, 9))
def test_zb1_pending_weights_peak_with_the_graphs(stages: int) -> None:
    """ZB-H1's stage s has at most s + 1 B's without their W (the first stage's W follows its B at once), and the
    moment it has them all is one where it holds its peak of graphs too: memory/pipeline.py adds the two peaks."""
    for micro in range(1, 25):
        for s, plan in enumerate(zb1(stages, micro)):
            graphs = pending = 0
            moments = set()
            for a in plan:
                graphs += {"F": 1, "W": -1}.get(a.kind, 0)
                pending += {"B": 1, "W": -1}.get(a.kind, 0)
                moments.add((graphs, pending))
            assert peak_pending_weights(plan) == min(s + 1, micro)
            assert (peak_in_flight(plan), peak_pending_weights(plan)) in moments, (stages, micro, s)
    assert all(peak_pending_weights(plan) == 0 for plan in one_f_one_b(stages, 8))


def test_one_f_one_b_order_on_two_stages() -> None:
    first, last = one_f_one_b(2, 3)
    assert [a for a in first if a.kind in ("F", "B")] == [Action("F", 0), Action("F", 1), Action("B", 0),
                                                         Action("F", 2), Action("B", 1), Action("B", 2)]
    assert [a for a in last if a.kind in ("F", "B")] == [Action("F", 0), Action("B", 0), Action("F", 1),
                                                        Action("B", 1), Action("F", 2), Action("B", 2)]


def test_one_f_one_b_exchanges_on_two_stages() -> None:
    """Megatron's pairing: send-forward-receive-backward on the first stage, send-backward-receive-forward on
    the second, posted together."""
    def ex(*ops: str) -> Exchange:
        return Exchange(tuple(Action(o.split()[0], int(o.split()[1])) for o in ops))  # type: ignore[arg-type]
    f, b = (lambda m: Action("F", m)), (lambda m: Action("B", m))
    first, last = build_plans("1f1b", 2, 3)
    assert first == [f(0), ex("SEND_F 0"), f(1), ex("SEND_F 1", "RECV_B 0"), b(0), f(2), ex("SEND_F 2", "RECV_B 1"),
                     b(1), ex("RECV_B 2"), b(2)]
    assert last == [ex("RECV_F 0"), f(0), b(0), ex("SEND_B 0", "RECV_F 1"), f(1), b(1), ex("SEND_B 1", "RECV_F 2"),
                    f(2), b(2), ex("SEND_B 2")]


def test_a_broken_schedule_is_caught() -> None:
    plans = gpipe(2, 2)
    plans[0] = [a for a in plans[0] if a != Action("SEND_F", 1)]  # stage 1's RECV_F 1 waits for it forever
    with pytest.raises(ValueError, match=r"deadlocks: stages wait on \{0: \{RECV_B 0\}, 1: \{RECV_F 1\}\}"):
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


def test_partition_balances_compute_not_parameters() -> None:
    """GPT-2 124M, tied: the 38.6M-parameter embedding costs no compute (a lookup), the LM head on the last
    stage does. By hand, per token: a block 6 * 7,087,872 + 12 * 768 * 1024 = 51.96 MFLOP, the head and loss
    6 * 768 * 50304 + 6 * 50304 = 232.1 MFLOP (4.5 blocks' worth): 8 blocks | 4 blocks + head = 415.7 | 440.0,
    where 9 | 3 + head would be 467.7 | 388.0. (Balancing by parameters, as before, gave 3 | 9.)"""
    cfg = load_config(None, ["model.n_layer=12", "model.n_embd=768", "model.n_head=12", "model.block_size=1024",
                             "model.vocab_size=50304", "model.tie_embeddings=true", "model.pos_emb=learned",
                             "model.mlp=gelu", "model.bias=true"])
    with torch.device("meta"):
        model = GPT(cfg.model)
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert block_params(shapes, cfg.model)[0] == 7_087_872  # 12 * 768^2 weights + 13 * 768 biases and norms
    assert [len(r) for r in stage_ranges(cfg.model, 2, shapes)] == [8, 4]
    assert describe_stages(cfg.model, stage_ranges(cfg.model, 2, shapes), shapes) == (
        "blocks 0-7 415.7 MFLOP/token (49%), blocks 8-11 440.0 MFLOP/token (51%)")
    assert [len(r) for r in stage_ranges(cfg.model, 2, shapes, [3, 9])] == [3, 9]  # parallel.pp_layers wins


def test_partition_counts_moe_blocks_by_active_experts() -> None:
    """Uneven blocks: with one block in two MoE (8 experts, top-2) the heavier blocks spread over the stages.
    An MoE block's experts count at top_k / n_experts of their parameters, as GPT.num_params(active=True)."""
    cfg = load_config("configs/moe.yaml", ["model.n_layer=4", "model.moe_every=2"])
    with torch.device("meta"):
        model = GPT(cfg.model)
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    counts = block_params(shapes, cfg.model)
    assert sum(counts) == model.num_params(active=True) - sum(
        p.numel() for n, p in model.named_parameters() if not n.startswith("blocks."))
    assert counts[0] == counts[2] != counts[1] == counts[3]
    assert [len(r) for r in partition_layers(4, 2, block_weight=[1, 3, 1, 3])] == [2, 2]
    assert [len(r) for r in partition_layers(4, 2, block_weight=[3, 3, 1, 1])] == [1, 3]


def test_split_at_tp4_with_fewer_kv_heads_than_ranks_is_the_whole_models() -> None:
    """GQA with 2 KV heads at tp=4: each rank's fused QKV holds its 2 query heads and the one KV head they read
    (replicated over 2 ranks), so 4x its rows (16 heads) is not the whole layer's 12. The cut reads each sliced
    layer's whole shapes instead: the tp=4 slice splits 7 | 1 as the whole model (4x its rows gave 6 | 2). Built on
    the meta device over a fake 4-rank group (no processes: the layers only read its size and rank)."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dist_llm.parallel.pipeline.stage import whole_shapes
    from dist_llm.parallel.tensor.plan import TensorParallelFactory

    cfg = load_config(None, ["model.n_layer=8", "model.n_head=8", "model.n_kv_head=2", "model.n_embd=128",
                             "model.vocab_size=8192", "parallel.tp=4", "parallel.pp=2"])
    with torch.device("meta"):
        whole = GPT(cfg.model)
    shapes = [(n, tuple(p.shape)) for n, p in whole.named_parameters()]
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        ctx = SimpleNamespace(tp_group=dist.group.WORLD, comm=None, tp=4, tp_rank=1, device=torch.device("meta"))
        with torch.device("meta"):
            sliced = GPT(cfg.model, TensorParallelFactory(cfg, ctx))  # type: ignore[arg-type]
    finally:
        dist.destroy_process_group()
    assert tuple(sliced.blocks[0].attn.qkv.weight.shape) == (4 * 16, 128)  # (2 + 1 + 1 heads of 16)
    assert whole_shapes(sliced, tp=4) == shapes
    assert stage_ranges(cfg.model, 2, whole_shapes(sliced, tp=4)) == [range(0, 7), range(7, 8)]


@pytest.mark.parametrize(("args", "message"), [
    ((2, 4), "parallel.pp: 4 stages need at least as many blocks, model.n_layer=2"),
    ((6, 2, [2, 2]), "parallel.pp_layers: [2, 2] must be 2 positive counts summing to model.n_layer=6"),
    ((6, 3, [3, 3, 0]), "parallel.pp_layers: [3, 3, 0] must be 3 positive counts"),
])
def test_partition_errors_name_the_key(args: tuple, message: str) -> None:
    n, p, *explicit = args
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        partition_layers(n, p, explicit=explicit[0] if explicit else None)


@pytest.mark.parametrize(("overrides", "message"), [
    (["parallel.pp=2", "parallel.pp_schedule=zb1", "train.compile=true"],
     "parallel.pp_schedule: zb1 splits each backward in two, which compiled blocks cannot; set train.compile=false "
     "or use pp_schedule=1f1b"),
    (["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual=2", "parallel.dp=1",
      "train.global_batch_size=6", "train.micro_batch_size=2"],
     "parallel.pp_schedule: interleaved needs the micro-batches per step (train.global_batch_size / "
     "(train.micro_batch_size * dp) = 3) to be a multiple of parallel.pp=2"),
    (["parallel.pp=2", "parallel.pp_schedule=interleaved"],
     "parallel.pp_virtual: pp_schedule=interleaved needs 2 or more chunks per stage, got 1"),
    (["parallel.pp=2", "parallel.pp_virtual=2"],
     "parallel.pp_virtual: 2 chunks per stage need parallel.pp > 1 and parallel.pp_schedule=interleaved"),
    (["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual=3"],
     "parallel.pp_virtual: 2 stages x 3 chunks need at least as many blocks, model.n_layer=4"),
    (["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual=2", "parallel.pp_layers=[1, 3]"],
     "parallel.pp_layers: [1, 3] must be 4 positive counts summing to model.n_layer=4"),
    (["parallel.pp_virtual=0"], "parallel.pp_virtual: must be positive, got 0"),
    (["parallel.pp_overlap_p2p=true"],
     "parallel.pp_overlap_p2p: overlaps the pipeline's point-to-point exchanges, needs parallel.pp > 1"),
    (["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.pp_schedule=zb1"],
     "parallel.pp_schedule: zb1 with parallel.sequence_parallel would run each layer's sequence-parallel backward "
     "twice; use pp_schedule=1f1b or sequence_parallel=false"),
    (["parallel.pp=2", "parallel.dp=2", "train.micro_batch_size=4", "parallel.zero_stage=2", "parallel.pp_schedule=interleaved",
      "parallel.pp_virtual=2"],
     "parallel.zero_stage: 2 with pp_schedule=interleaved would reduce-scatter every bucket once per chunk; use "
     "zero_stage 1 or pp_schedule=1f1b"),
])
def test_schedule_refusals_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert str(info.value) == message


@pytest.mark.parametrize(("overrides", "expected"), [
    ([], False), (["parallel.pp=2"], False), (["parallel.pp=2", "parallel.pp_schedule=gpipe"], False),
    (["parallel.pp=2", "parallel.pp_schedule=zb1"], True),
    (["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual=2"], True),
    (["parallel.pp=2", "parallel.pp_schedule=zb1", "parallel.pp_overlap_p2p=false"], False),
    (["parallel.pp=2", "parallel.pp_overlap_p2p=true"], True),
])
def test_overlapped_exchanges_by_default_where_they_shorten_the_step(overrides: list[str], expected: bool) -> None:
    """parallel.pp_overlap_p2p unset: on for zb1 and interleaved (test_zb1_with_overlap, test_interleaved_with_overlap:
    shorter steps), off for GPipe and 1F1B (the same steps) and without a pipeline; set, as set."""
    assert overlap_p2p(load_config(None, overrides)) is expected


def test_memory_counts_zb1s_held_back_micro_batches() -> None:
    """`dist-llm memory`'s activations per stage: 1F1B holds p - s micro-batches on stage s, ZB-H1 p on every stage
    (a W held back keeps its micro-batch's activations below its weight ops), GPipe all m."""
    from dist_llm.memory import activation_bytes

    held = {}
    for schedule in ("gpipe", "1f1b", "zb1"):
        cfg = load_config(None, ["model.n_layer=4", "parallel.pp=2", f"parallel.pp_schedule={schedule}",
                                 "train.micro_batch_size=2", "train.global_batch_size=16"])
        held[schedule] = [activation_bytes(cfg, dp=1, tp=1, pp=2, pp_rank=r) for r in (0, 1)]
    # m = 8 micro-batches: GPipe holds 8 on each stage, 1F1B 2 and 1, ZB-H1 2 and 2 (abs 1: each figure rounded),
    # its last stage's held-back one without the loss's log-softmax and targets (freed at B: test_pipeline)
    assert held["zb1"][0] == held["1f1b"][0] == pytest.approx(held["gpipe"][0] / 4, abs=1)
    assert held["1f1b"][1] == pytest.approx(held["gpipe"][1] / 8, abs=1)
    loss_part = (cfg.model.padded_vocab + 2) * 4 * 2 * cfg.model.block_size
    assert held["zb1"][1] == pytest.approx(2 * held["1f1b"][1] - loss_part, abs=1)


def test_interleaved_chunks_balance_and_keep_whole_model_names() -> None:
    """pp=2 x 2 chunks of 8 blocks: the FLOP balance runs over the 4 virtual stages (the head's cost on the last
    pushes blocks forward), rank r holds runs r and r+2, and the cut keeps the whole model's parameter names."""
    from dist_llm.parallel.pipeline.stage import cut_to_stage, rank_chunks

    cfg = load_config(None, ["model.n_layer=8", "parallel.pp=2", "parallel.pp_schedule=interleaved",
                             "parallel.pp_virtual=2"])
    with torch.device("meta"):
        model = GPT(cfg.model)
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    ranges = stage_ranges(cfg.model, 4, shapes)
    assert rank_chunks(cfg.model, 2, 2, shapes) == [(ranges[0], ranges[2]), (ranges[1], ranges[3])]
    blocks, first, last = cut_to_stage(model, cfg, 2, 1)
    assert blocks == (ranges[1], ranges[3]) and (first, last) == (False, True)
    held = {int(n.split(".")[1]) for n, _ in model.named_parameters() if n.startswith("blocks.")}
    assert held == {*ranges[1], *ranges[3]}
    assert any(n.startswith("lm_head.") or n == "wte.weight" for n, _ in model.named_parameters())


def test_stage_clock_breakdown() -> None:
    """Where a step's seconds went on one stage (the bench's split of idle): by action kind, in exchanges, after the
    last action (the tail) and the rest; each computation's seconds in order for a replay."""
    from dist_llm.parallel.pipeline.executor import StageClock

    clock = StageClock(torch.device("cpu"))
    clock.start, clock.end = 0.0, 10.0
    clock.spans = [(0.0, 1.0), (1.5, 2.0), (2.5, 4.5), (5.0, 8.0)]
    clock.actions = [Action("F", 0), Action("F", 0, 1), Action("B", 0, 1), Action("W", 0)]
    clock.exchanges = [(1.0, 1.5), (8.0, 9.0)]
    got = clock.breakdown()
    assert got == {"F": 1.0, "count_F": 1, "F1": 0.5, "count_F1": 1, "B1": 2.0, "count_B1": 1, "W": 3.0,
                   "count_W": 1, "exchange": 1.5, "tail": 1.0, "other": 1.0}
    assert clock.busy_idle() == (6.5, 3.5)
    assert clock.action_seconds() == [("F", 0, 1.0), ("F1", 0, 0.5), ("B1", 0, 2.0), ("W", 0, 3.0)]


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_bench_refuses_a_budget_that_is_not_a_number_of_minutes(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--max-minutes inf (or nan) would let --until-decided run for ever: refused with one line, exit 2 (argparse)."""
    with pytest.raises(SystemExit) as stop:
        bench_pp.parse_args(["--until-decided", "--max-minutes", value])
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"error: --max-minutes: must be a number of minutes above 0, got {float(value)}")
