"""The progress line: rewritten in place on a terminal, whole lines in a log."""

import io

import pytest

from soapjax.base import _progress as progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    progress.end_progress()
    yield now
    progress.end_progress()


def test_a_log_gets_a_line_per_kind_of_status_and_one_every_ten_seconds(monkeypatch, clock):
    log = io.StringIO()
    monkeypatch.setattr(progress.sys, "stderr", log)
    for k in range(1, 49):  # 48 statuses of one kind within a second: the first is written
        progress.print_progress(f"search: scoring Megatron's grid, {k} of 48")
    progress.print_progress("search: chains in 2 processes: 0 of 11 done")  # a new kind
    clock[0] += progress.LOG_EVERY_S
    progress.print_progress("search: chains in 2 processes: 8 of 11 done")  # ten seconds on
    clock[0] += 1
    progress.print_progress("search: chains in 2 processes: 9 of 11 done")
    progress.end_progress()
    assert log.getvalue() == ("search: scoring Megatron's grid, 1 of 48\n"
                              "search: chains in 2 processes: 0 of 11 done\n"
                              "search: chains in 2 processes: 8 of 11 done\n")


def test_a_terminal_gets_one_line_rewritten_and_ended(monkeypatch, clock):
    tty = _Terminal()
    monkeypatch.setattr(progress.sys, "stderr", tty)
    progress.print_progress("1/3 shard programs")
    progress.print_progress("2/3 shard programs")
    progress.end_progress()
    progress.end_progress()  # nothing open: nothing more
    width = progress.WIDTH
    assert tty.getvalue() == ("\r" + "1/3 shard programs".ljust(width)
                              + "\r" + "2/3 shard programs".ljust(width) + "\n")


def test_a_notebook_draws_carriage_returns(monkeypatch):
    monkeypatch.setitem(progress.sys.modules, "ipykernel", object())
    assert progress.rewrites(io.StringIO())
    monkeypatch.delitem(progress.sys.modules, "ipykernel")
    assert not progress.rewrites(io.StringIO()) and progress.rewrites(_Terminal())


def test_the_next_run_starts_with_its_first_status(monkeypatch, clock):
    log = io.StringIO()
    monkeypatch.setattr(progress.sys, "stderr", log)
    progress.print_progress("search: chain done 5 proposals")
    progress.end_progress()
    progress.print_progress("search: chain done 7 proposals")  # same kind, same second
    assert log.getvalue().count("\n") == 2
