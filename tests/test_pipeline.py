"""The pipeline dimension's rules (soapjax.strategy.pipeline): schedules as per-stage action orders,
and their timing (`time_schedule`) against closed forms, hand-derived timelines and a naive
fixed-point simulation."""

from __future__ import annotations

import itertools
import random

import pytest

from soapjax.base.errors import PlanError
from soapjax.strategy import _schedule_time, pipeline
from soapjax.strategy.pipeline import (
    SCHEDULES,
    Action,
    ChunkTimes,
    TimedAction,
    TimedSend,
    check_pipeline,
    chunks_of,
    device_orders,
    pipeline_error,
    stage_holds,
    time_schedule,
)

CASES = [("gpipe", 4, 6, 1), ("1f1b", 4, 6, 1), ("1f1b", 4, 2, 1), ("1f1b", 1, 3, 1),
         ("interleaved", 4, 8, 2), ("interleaved", 2, 2, 3), ("interleaved", 3, 6, 4),
         ("zb-h1", 4, 6, 1), ("zb-h1", 4, 2, 1), ("zb-h1", 1, 3, 1),
         ("zb-interleaved", 4, 8, 2), ("zb-interleaved", 3, 6, 4)]


def run_in_lockstep(orders, S, v):
    """Unit-time event simulation: each stage runs its next action once its inputs exist (F of
    the chunk before; B of the chunk after and its own F). Returns the finishing tick, or raises
    on a deadlock."""
    done, pos, tick, last = set(), [0] * S, 0, S * v - 1
    while any(p < len(o) for p, o in zip(pos, orders)):
        ready = []
        for s, o in enumerate(orders):
            if pos[s] == len(o):
                continue
            a = o[pos[s]]
            need = ([("F", a.microbatch, a.chunk - 1)] if a.kind == "F" and a.chunk else []) + (
                [("F", a.microbatch, a.chunk)] + ([("B", a.microbatch, a.chunk + 1)]
                                                  if a.chunk < last else [])
                if a.kind == "B" else []) + (
                [("B", a.microbatch, a.chunk)] if a.kind == "W" else [])
            if all(n in done for n in need):
                ready.append((s, a))
        assert ready, f"deadlock at tick {tick}: {[o[p] for p, o in zip(pos, orders)]}"
        for s, a in ready:
            done.add(tuple(a))
            pos[s] += 1
        tick += 1
    return tick


@pytest.mark.parametrize("schedule, S, M, v", CASES)
def test_every_stage_runs_each_of_its_chunks_forward_then_backward_once(schedule, S, M, v):
    orders = device_orders(schedule, S, M, v)
    assert len(orders) == S
    for s, order in enumerate(orders):
        kinds = "FBW" if SCHEDULES[schedule].splits_backward else "FB"
        want = {(k, m, c) for k in kinds for m in range(M) for c in chunks_of(s, S, v)}
        assert sorted(map(tuple, order)) == sorted(want)
        for m, c in itertools.product(range(M), chunks_of(s, S, v)):
            assert order.index(Action("F", m, c)) < order.index(Action("B", m, c))
            if "W" in kinds:
                assert order.index(Action("B", m, c)) < order.index(Action("W", m, c))
    run_in_lockstep(orders, S, v)


def test_1f1b_keeps_at_most_S_minus_s_microbatches_in_flight():
    S, M = 4, 8
    for s, order in enumerate(device_orders("1f1b", S, M)):
        live = peak = 0
        for a in order:
            live += 1 if a.kind == "F" else -1
            peak = max(peak, live)
        assert peak == S - s
    gpipe = device_orders("gpipe", S, M)[0]
    assert [a.kind for a in gpipe] == ["F"] * M + ["B"] * M


def test_interleaved_follows_megatron_chunk_order():
    """Device 0 of 2 stages with 2 virtual stages and 4 microbatches: forwards go through chunk 0
    for microbatches 0, 1, then chunk 2 for them, then chunk 0 for 2, 3 ...; warm-up is
    (S - 1) * 2 + (v - 1) * S = 4 forwards."""
    order = device_orders("interleaved", 2, 4, 2)[0]
    fwd = [(a.microbatch, a.chunk) for a in order if a.kind == "F"]
    assert fwd == [(0, 0), (1, 0), (0, 2), (1, 2), (2, 0), (3, 0), (2, 2), (3, 2)]
    assert [a.kind for a in order[:5]] == ["F"] * 4 + ["F"]
    bwd = [(a.microbatch, a.chunk) for a in order if a.kind == "B"]
    assert bwd[:2] == [(0, 2), (1, 2)]


def test_bad_pipelines_are_refused_with_what_was_expected():
    with pytest.raises(PlanError, match="schedule 'zigzag' is not one of gpipe, 1f1b"):
        check_pipeline("zigzag", 2, 2)
    with pytest.raises(PlanError, match="microbatches must be an integer >= 1, got 0"):
        check_pipeline("1f1b", 2, 0)
    with pytest.raises(PlanError, match="2 virtual stages per device need a schedule of virtual "
                       r"stages \('interleaved', 'zb-interleaved' or 'zb-interleaved-gathered'\)"):
        check_pipeline("1f1b", 2, 4, 2)
    with pytest.raises(PlanError, match="needs 2 or more virtual stages"):
        check_pipeline("interleaved", 2, 4, 1)


def test_every_schedule_of_the_table_is_tested_and_follows_its_rules():
    """`SCHEDULES` is the one list of schedules: each order has cases here (orders and
    timing) and in tests/test__pipelined.py (run; the gathered-stash forms run the orders of
    the zero-bubble ones), and `pipeline_error` reads its row's rules."""
    assert {SCHEDULES[case[0]].order for case in CASES} == {r.order for r in SCHEDULES.values()}
    assert all(SCHEDULES[f"{name}-gathered"] == rules._replace(gathered_stash=True)
               for name, rules in SCHEDULES.items() if rules.splits_backward
               and not rules.gathered_stash)
    times = ChunkTimes.uniform(4, 1.0, 2.0, weight_s=0.5)  # one compiled order for both
    lean, gathered = (time_schedule(n, 4, 8, 1, times) for n in ("zb-h1", "zb-h1-gathered"))
    assert (lean.step_s, lean.stage_end_s) == (gathered.step_s, gathered.stage_end_s)
    assert gathered.schedule == "zb-h1-gathered"
    for name, rules in SCHEDULES.items():
        v = 2 if rules.virtual else 1
        assert pipeline_error(name, stages=4, microbatches=8, virtual=v) is None
        assert (pipeline_error(name, 4, 6, v) is None) is not rules.whole_rounds
        assert pipeline_error(name, 4, 8, 1 if rules.virtual else 2) is not None


# --- time_schedule ----------------------------------------------------------------------------


def naive_times(orders, S, v, times):
    """The timing rules solved by brute force: start from all-zero times and re-evaluate every
    action and every link (served in order of readiness, ties by microbatch) until nothing
    changes; with W actions in the orders, B runs its part of the backward and W the rest.
    Returns {action: (start, end)}."""
    C, ends = S * v, {}
    split = any(a.kind == "W" for order in orders for a in order)
    while True:
        arrive = {}
        links: dict[tuple[str, int], list] = {}
        for a in (a for order in orders for a in order):
            kind, m, c = a
            ready = ends.get(a, 0.0)
            if kind == "F" and c < C - 1:
                links.setdefault(("F", c % S), []).append((ready, m, c, ("F", m, c + 1)))
            if kind == "B" and c > 0:
                links.setdefault(("B", c % S), []).append((ready, m, c - 1, ("B", m, c - 1)))
        for queue in links.values():
            free = 0.0
            for ready, _, boundary, into in sorted(queue):
                free = max(ready, free) + (times.send_s[boundary] if S > 1 else 0.0)
                arrive[into] = free
        new = {}
        for order in orders:
            t = 0.0
            for a in order:
                t = max(t, arrive.get(tuple(a), 0.0))
                duration = {"F": times.forward_s[a.chunk],
                            "B": times.backward_s[a.chunk] - (times.weight_s[a.chunk] if split
                                                              else 0.0),
                            "W": times.weight_s[a.chunk]}[a.kind]
                new[a] = (t, t + duration)
                t += duration
        if {a: e for a, (_, e) in new.items()} == ends:
            return new
        ends = {a: e for a, (_, e) in new.items()}


@pytest.mark.parametrize("schedule, S, M, v", CASES, ids=[f"{c[0]}-S{c[1]}-M{c[2]}-v{c[3]}"
                                                          for c in CASES])
def test_time_schedule_equals_a_naive_fixed_point_on_random_times(schedule, S, M, v):
    rng = random.Random(f"{schedule}{S}{M}{v}")
    C = S * v
    backward = tuple(rng.randint(1, 8) / 4 for _ in range(C))
    times = ChunkTimes(tuple(rng.randint(1, 8) / 4 for _ in range(C)), backward,
                       tuple(rng.randint(0, 8) / 4 for _ in range(C - 1)),
                       tuple(b * rng.randint(0, 4) / 4 for b in backward))
    t = time_schedule(schedule, S, M, v, times)
    want = naive_times(device_orders(schedule, S, M, v), S, v, times)
    assert {task.action: (task.start_s, task.end_s) for task in t.tasks} == want
    actions = (3 if SCHEDULES[schedule].splits_backward else 2) * M * v
    assert [task.stage for task in t.tasks] == [s for s in range(S) for _ in range(actions)]
    assert t.step_s == max(end for _, end in want.values())
    assert t.stage_end_s == tuple(max(want[a][1] for a in o) for o in t.orders)
    assert t.busy_s == tuple(M * sum(times.forward_s[c] + times.backward_s[c]
                                     for c in chunks_of(s, S, v)) for s in range(S))
    assert len(t.sends) == (2 * M * (C - 1) if S > 1 else 0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("S, M", [(1, 3), (2, 1), (4, 3), (4, 8), (8, 16)])
def test_plain_pipelines_take_M_plus_S_minus_1_slots(schedule, S, M):
    f, b = 1.0, 2.0
    t = time_schedule(schedule, S, M, 1, ChunkTimes.uniform(S, f, b))
    assert t.step_s == (M + S - 1) * (f + b)
    assert t.busy_s == (M * (f + b),) * S
    assert t.bubble_fraction == 1 - M / (M + S - 1)
    assert t.stage_end_s[0] == t.step_s  # stage 0 runs the last backward
    if schedule == "1f1b":
        assert t.in_flight == tuple(min(S - s, M) for s in range(S))
    else:
        assert t.in_flight == (M,) * S


@pytest.mark.parametrize("S, M", [(2, 2), (4, 4), (4, 8), (8, 16), (8, 64), (64, 512)])
@pytest.mark.parametrize("f, b, w", [(1.0, 2.0, 1.0), (1.0, 2.0, 0.5), (1.0, 2.5, 0.75)])
def test_zero_bubble_h1_takes_S_minus_1_slots_of_f_plus_b_minus_2w(S, M, f, b, w):
    """ZB-H1 (Qi et al. 2024): with the backward's weight part w deferred, the bubble is
    (S - 1)(f + b - 2 w), against 1F1B's (S - 1)(f + b) (M >= S; times exact in binary), and
    every stage holds up to S microbatches (1F1B's first stage's count)."""
    times = ChunkTimes.uniform(S, f, b, weight_s=w)
    t = time_schedule("zb-h1", S, M, 1, times)
    assert t.step_s == M * (f + b) + (S - 1) * (f + b - 2 * w)
    assert time_schedule("1f1b", S, M, 1, times).step_s == (M + S - 1) * (f + b)
    assert t.busy_s == (M * (f + b),) * S
    assert t.in_flight == (S,) * S


def test_zero_bubble_h1_orders_each_stages_w_after_the_b_s_microbatches_later():
    assert [" ".join(f"{a.kind}{a.microbatch}" for a in o)
            for o in device_orders("zb-h1", 3, 4)] == [
        "F0 F1 F2 B0 W0 F3 B1 W1 B2 W2 B3 W3",
        "F0 F1 B0 F2 B1 W0 F3 B2 W1 B3 W2 W3",
        "F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3"]


@pytest.mark.parametrize("S, v, M", [(4, 2, 8), (8, 3, 32), (35, 3, 280)])
def test_zero_bubble_interleaving_shortens_the_interleaved_bubble_in_the_same_memory(S, v, M):
    """The interleaved order with ZB-H1's rule for its W's: faster than the interleaved
    schedule wherever the weights' part is some of the backward, as fast where it is none,
    and no stage holding more microbatches (forward run, W not yet) than the first stage
    under the interleaved schedule does."""
    for f, b, w in ((1.0, 2.0, 1.0), (1.0, 2.25, 0.75), (1.0, 2.0, 0.0)):
        times = ChunkTimes.uniform(S * v, f / v, b / v, weight_s=w / v)
        zb = time_schedule("zb-interleaved", S, M, v, times)
        plain = time_schedule("interleaved", S, M, v, times)
        assert zb.step_s < plain.step_s if w else zb.step_s == pytest.approx(plain.step_s)
        assert max(zb.in_flight) == zb.in_flight[0] == plain.in_flight[0]
    # one virtual stage's rule is ZB-H1's
    assert [a for a in device_orders("zb-h1", 4, 8)[2]] == list(
        pipeline._weights_deferred(pipeline._1f1b(2, 4, 8, 1), 2))


def test_a_split_backward_holds_the_stash_of_what_waits_for_its_w():
    """ZB-H1 over 3 stages and 4 microbatches: stage 1 passes through 2 forwards waiting for
    their B and 1 B waiting for its W, or 1 and 2; with a stash of half an activation its
    peak is 2.5 activations (1F1B's stage 1: 2); at a stash of one, `in_flight`."""
    t = time_schedule("zb-h1", 3, 4, 1, ChunkTimes.uniform(3, 1.0, 2.0, weight_s=1.0))
    assert t.held_pairs[1] == ((1, 2), (2, 1))
    assert t.held(1, 0.5) == 2.5 and t.held(1, 1.0) == t.in_flight[1] == 3
    assert t.held(1, 2.0) == 5.0  # recomputing: the stash is more than the forward keeps
    plain = time_schedule("1f1b", 3, 4, 1, ChunkTimes.uniform(3, 1.0, 2.0))
    assert plain.held_pairs == () and plain.held(1, 0.5) == plain.in_flight[1] == 2


def test_weight_times_are_checked():
    with pytest.raises(PlanError, match=r"weight_s\[0\] is 3.0, more than the chunk's whole"):
        ChunkTimes((1.0,), (2.0,), (), (3.0,))
    with pytest.raises(PlanError, match="2 weight-gradient times"):
        ChunkTimes((1.0,), (2.0,), (), (0.5, 0.5))
    assert ChunkTimes((1.0,), (2.0,), ()).weight_s == (0.0,)


@pytest.mark.parametrize("S, v, M", [(2, 2, 2), (2, 2, 6), (4, 2, 8), (4, 4, 4), (4, 4, 12),
                                     (8, 2, 16), (1, 4, 3)])
@pytest.mark.parametrize("f, b", [(1.0, 1.0), (1.0, 2.0), (2.0, 1.0)])
def test_interleaving_divides_the_bubble_by_v(S, v, M, f, b):
    """Narayanan et al. 2021, section 2.2: with v chunks per device each of f/v and b/v, the
    bubble is (S - 1)(f + b) / v, so the step is (M + (S - 1) / v)(f + b), and it is exact here
    (M a multiple of S; v a power of two keeps the sums exact in binary)."""
    t = time_schedule("interleaved", S, M, v, ChunkTimes.uniform(S * v, f / v, b / v))
    assert t.step_s == (M + (S - 1) / v) * (f + b)
    plain = time_schedule("1f1b", S, M, 1, ChunkTimes.uniform(S, f, b))
    assert plain.step_s - M * (f + b) == v * (t.step_s - M * (f + b))
    # Megatron's warm-up holds (S - s - 1) * 2 + (v - 1) * S forwards, then one more
    warmup = [M * v if M == S else (S - s - 1) * 2 + (v - 1) * S for s in range(S)]
    assert t.in_flight == tuple(min(w + 1, M * v) for w in warmup)


def test_sends_add_their_latency_on_the_critical_path():
    t = time_schedule("1f1b", 2, 1, 1, ChunkTimes.uniform(2, 1.0, 1.0, 0.5))
    assert t.step_s == 1 + 0.5 + 1 + 1 + 0.5 + 1
    assert t.tasks == (TimedAction(0, Action("F", 0, 0), 0.0, 1.0),
                       TimedAction(0, Action("B", 0, 0), 4.0, 5.0),
                       TimedAction(1, Action("F", 0, 1), 1.5, 2.5),
                       TimedAction(1, Action("B", 0, 1), 2.5, 3.5))
    assert t.sends == (TimedSend(0, 1, 0, 0, "F", 1.0, 1.5),  # ordered as their producers
                       TimedSend(1, 0, 0, 0, "B", 3.5, 4.0))
    assert t.stage_end_s == (5.0, 3.5)


@pytest.mark.parametrize("M", [1, 4, 8])
def test_gpipe_hides_sends_once_full_and_1f1b_does_not(M):
    """GPipe pays each of the 2 (S - 1) boundary crossings once, on the first forward and the
    last backward; in 1F1B a stage waits on the gradient of a microbatch it has just sent on."""
    S, f, b, send = 4, 1.0, 2.0, 0.25
    gpipe = time_schedule("gpipe", S, M, 1, ChunkTimes.uniform(S, f, b, send))
    assert gpipe.step_s == (M + S - 1) * (f + b) + 2 * (S - 1) * send
    one_f_one_b = time_schedule("1f1b", S, M, 1, ChunkTimes.uniform(S, f, b, send))
    assert one_f_one_b.step_s == {1: 13.5, 4: 23.5, 8: 37.0}[M]
    naive = naive_times(one_f_one_b.orders, S, 1, ChunkTimes.uniform(S, f, b, send))
    assert max(end for _, end in naive.values()) == one_f_one_b.step_s


def test_a_slow_link_sends_one_microbatch_at_a_time():
    """GPipe, 2 stages, 4 microbatches of f = b = 1 s, sends of 2 s: the activations leave
    stage 0 at 1, 2, 3, 4 s but the link delivers them at 3, 5, 7, 9 s; stage 1 ends its
    backwards at 14 s, the gradients arrive at 13, 15, 17, 19 s, and stage 0 ends at 20 s."""
    t = time_schedule("gpipe", 2, 4, 1, ChunkTimes.uniform(2, 1.0, 1.0, 2.0))
    assert t.step_s == 20.0
    spans = {(s.kind, s.microbatch): (s.start_s, s.end_s) for s in t.sends}
    assert spans == {("F", 0): (1, 3), ("F", 1): (3, 5), ("F", 2): (5, 7), ("F", 3): (7, 9),
                     ("B", 0): (11, 13), ("B", 1): (13, 15), ("B", 2): (15, 17),
                     ("B", 3): (17, 19)}
    assert all((s.sender, s.receiver) == ((0, 1) if s.kind == "F" else (1, 0)) for s in t.sends)
    assert [task.start_s for task in t.tasks if task.stage == 1] == [3, 5, 7, 9, 10, 11, 12, 13]
    assert t.stage_end_s == (20.0, 14.0)


def test_interleaved_sends_wrap_from_the_last_stage_to_stage_0():
    t = time_schedule("interleaved", 2, 2, 2, ChunkTimes.uniform(4, 1.0, 1.0, 0.25))
    wrap = {(s.kind, s.microbatch, s.boundary): (s.sender, s.receiver) for s in t.sends
            if s.boundary == 1}
    assert wrap == {("F", 0, 1): (1, 0), ("F", 1, 1): (1, 0), ("B", 0, 1): (0, 1),
                    ("B", 1, 1): (0, 1)}
    f02 = next(task for task in t.tasks if task.action == Action("F", 0, 2))
    f01 = next(task for task in t.tasks if task.action == Action("F", 0, 1))
    assert f02.stage == 0 and f02.start_s >= f01.end_s + 0.25


def test_the_slowest_stage_sets_the_steady_state_period():
    """Stage 2 of 4 is the slow one (f + b = 8 s against 3 s): once the pipeline is full, each
    further microbatch adds 8 s under both schedules, and GPipe takes the flow-shop time
    sum(f + b) + (M - 1) * 8."""
    f, b = (1.0, 1.0, 3.0, 1.0), (2.0, 2.0, 5.0, 2.0)
    times = ChunkTimes(f, b, (0.0,) * 3)
    for schedule in ("gpipe", "1f1b"):
        steps = [time_schedule(schedule, 4, M, 1, times).step_s for M in range(1, 10)]
        assert [y - x for x, y in itertools.pairwise(steps[1:])] == [8.0] * 7
        if schedule == "gpipe":
            assert steps == [17.0 + 8.0 * (M - 1) for M in range(1, 10)]
    # When the slowest forward and the slowest backward are on different stages, GPipe's period
    # is max f + max b (two flow shops, 2 + 4 s), 1F1B's the slowest stage's f + b (1 + 4 s).
    times = ChunkTimes((1.0, 2.0, 1.0, 1.0), (1.0, 1.0, 1.0, 4.0), (0.0,) * 3)
    gpipe = [time_schedule("gpipe", 4, M, 1, times).step_s for M in (8, 9)]
    one_f_one_b = [time_schedule("1f1b", 4, M, 1, times).step_s for M in (8, 9)]
    assert (gpipe[1] - gpipe[0], one_f_one_b[1] - one_f_one_b[0]) == (6.0, 5.0)


def test_bad_chunk_times_say_what_was_expected():
    with pytest.raises(PlanError, match="has 2 forward times but 3 backward times"):
        ChunkTimes((1, 1), (1, 1, 1), (0,))
    with pytest.raises(PlanError, match="of 3 chunks needs 2 send times .* got 3"):
        ChunkTimes((1, 1, 1), (1, 1, 1), (0, 0, 0))
    with pytest.raises(PlanError, match=r"ChunkTimes.backward_s\[1\] is -1.0; times must be "
                       "finite and >= 0"):
        ChunkTimes((1, 1), (1, -1), (0,))
    with pytest.raises(PlanError, match=r"send_s\[0\] is nan"):
        ChunkTimes((1, 1), (1, 1), (float("nan"),))
    with pytest.raises(PlanError, match="must be a sequence of times in seconds, got 'ab'"):
        ChunkTimes("ab", (1, 1), (0,))
    with pytest.raises(PlanError, match="got none"):
        ChunkTimes((), (), ())
    with pytest.raises(PlanError, match="4 stages x 2 virtual stages make 8 chunks, but the "
                       "ChunkTimes has times for 4"):
        time_schedule("interleaved", 4, 8, 2, ChunkTimes.uniform(4, 1.0, 1.0))
    with pytest.raises(PlanError, match="needs 2 or more virtual stages"):
        time_schedule("interleaved", 4, 8, 1, ChunkTimes.uniform(4, 1.0, 1.0))
    assert ChunkTimes([1, 2], [3, 4], [0]).forward_s == (1.0, 2.0)  # lists become float tuples


@pytest.mark.parametrize("schedule, S, M, v", [("1f1b", 8, 1024, 1), ("interleaved", 4, 512, 4),
                                               ("gpipe", 4, 2048, 1), ("1f1b", 64, 512, 1),
                                               ("zb-h1", 16, 512, 1)])
def test_steady_periods_are_skipped_and_the_timeline_stays_the_same(schedule, S, M, v,
                                                                      monkeypatch):
    # `_timeline` skips the periods of a steady pipeline (a period a constant later than the
    # one before); the action-by-action loop (`recorded`, the timeline's records) gives
    # the same stage ends, on chunk times a folded stage gives (the first and last chunks
    # apart) and on random ones, for the split backward too (ZB-H1's W actions)
    compiled = pipeline._compile(schedule, S, M, v)
    assert compiled.periodic is not None and compiled.periodic.periods >= 3
    jumped = []
    jump = _schedule_time._jump
    monkeypatch.setattr(_schedule_time, "_jump",
                        lambda *a: jumped.append(jump(*a)) or jumped[-1])
    rng = random.Random(f"{schedule}{S}{M}{v}")
    C = S * v
    for uniform in (True, False):
        if uniform:
            f, b = rng.uniform(0.5, 1.5), rng.uniform(1.0, 3.0)
            times = ChunkTimes((f * 1.3, *[f] * (C - 2), f * 2.1),
                               (b * 1.2, *[b] * (C - 2), b * 1.9),
                               (rng.uniform(0.0, 0.3),) * (C - 1))
        else:
            times = ChunkTimes(tuple(rng.uniform(0.3, 2.0) for _ in range(C)),
                               tuple(rng.uniform(0.5, 4.0) for _ in range(C)),
                               tuple(rng.uniform(0.0, 0.5) for _ in range(C - 1)))
        pipeline.forget_timelines()
        t = pipeline.time_schedule(schedule, S, M, v, times)
        start, end, _, _ = _schedule_time.recorded(S, M, v, times, compiled)
        ends = [0.0] * S
        for task, stage in zip(compiled.steps[0], compiled.steps[1]):
            ends[stage] = max(ends[stage], end[task])
        assert t.stage_end_s == pytest.approx(ends, rel=1e-12)
        assert t.step_s == pytest.approx(max(end), rel=1e-12)
    # 1F1B and interleaved stages wait for each other and settle; GPipe's stages run their
    # forwards each at its own pace (none waits for a backward), so nothing repeats exactly
    assert any(jumped) == (schedule != "gpipe")


def sweep_order(orders, M, C):
    """The dependency order as the plain sweeps make it: round k runs each stage's action at
    position k, in sweeps over the stages (stage order) until all have run; None where a
    sweep runs nothing (an action reads one of a later round)."""
    ran, out = set(), []
    for k in range(max(map(len, orders))):
        todo = [s for s, order in enumerate(orders) if k < len(order)]
        while todo:
            left = []
            for s in todo:
                kind, m, c = orders[s][k]
                need = {"F": ("F", m, c - 1), "B": ("B", m, c + 1)}.get(kind)
                if need is None or not 0 <= need[2] < C or need in ran:
                    ran.add((kind, m, c))
                    out.append((s, k))
                else:
                    left.append(s)
            if len(left) == len(todo):
                return None
            todo = left
    return out


def _takes(schedule, S, M, v):
    try:
        check_pipeline(schedule, S, M, v)
    except PlanError:
        return False
    return True


ORDER_CASES = [(schedule, S, M, v) for schedule in SCHEDULES
               for S, M, v in [(2, 4, 1), (4, 8, 1), (3, 7, 1), (8, 16, 1), (4, 8, 2), (3, 6, 4),
                               (8, 16, 2)]
               if _takes(schedule, S, M, v)]


@pytest.mark.parametrize("schedule, S, M, v", ORDER_CASES,
                         ids=[f"{c[0]}-S{c[1]}-M{c[2]}-v{c[3]}" for c in ORDER_CASES])
def test_the_dependency_order_is_the_plain_sweeps_order(schedule, S, M, v):
    # `_dependency_order` works a round's sweeps out past its first (GPipe's backwards take
    # S sweeps a round); the order, which links serve their sends in, stays the sweeps'
    orders = device_orders(schedule, S, M, v)
    want = sweep_order(orders, M, S * v)
    got = _schedule_time._dependency_order(orders, M, S * v)
    assert got == (want if want is not None else _schedule_time._greedy_order(orders, M, S * v))
    assert sorted(got) == sorted((s, k) for s, o in enumerate(orders) for k in range(len(o)))


def test_what_a_stage_holds_comes_from_the_orders_alone():
    # `stage_holds` (no compiled dependency order) says what the timed pipeline says, for
    # every schedule and shape of ORDER_CASES
    for schedule, S, M, v in ORDER_CASES:
        timeline = time_schedule(schedule, S, M, v, ChunkTimes.uniform(S * v, 1.0, 2.0))
        holds = stage_holds(schedule, S, M, v)
        assert holds == (timeline.in_flight, timeline.held_pairs), (schedule, S, M, v)
        assert [holds.held(s, 0.5) for s in range(S)] == [timeline.held(s, 0.5)
                                                          for s in range(S)]
    with pytest.raises(PlanError):
        stage_holds("interleaved", 4, 8, 1)
