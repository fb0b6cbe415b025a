"""The pipeline dimension's rules (soapjax.pipeline): schedules as per-stage action orders."""

from __future__ import annotations

import itertools

import pytest

from soapjax.errors import PlanError
from soapjax.pipeline import Action, check_pipeline, chunks_of, device_orders

CASES = [("gpipe", 4, 6, 1), ("1f1b", 4, 6, 1), ("1f1b", 4, 2, 1), ("1f1b", 1, 3, 1),
         ("interleaved", 4, 8, 2), ("interleaved", 2, 2, 3), ("interleaved", 3, 6, 4)]


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
                if a.kind == "B" else [])
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
        want = {(k, m, c) for k in "FB" for m in range(M) for c in chunks_of(s, S, v)}
        assert sorted(map(tuple, order)) == sorted(want)
        for m, c in itertools.product(range(M), chunks_of(s, S, v)):
            assert order.index(Action("F", m, c)) < order.index(Action("B", m, c))
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
    with pytest.raises(PlanError, match="2 virtual stages per device need the 'interleaved'"):
        check_pipeline("1f1b", 2, 4, 2)
    with pytest.raises(PlanError, match="needs 2 or more virtual stages"):
        check_pipeline("interleaved", 2, 4, 1)
