"""The peer watch's judgement, in one process over a real store: which peers are gone, and when a gone peer
fails this rank (the processes themselves: tests/engine/test_peer_watch_launch.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from bagua_lightning.engine import peer_watch
from bagua_lightning.engine.peer_watch import PeerFailure, WatchSettings, _published, _State, _Watch


def _ended_pid() -> int:
    """The pid of a process this test started and that has ended (and was reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid


def _watch(world_size: int = 3, **settings: float) -> _Watch:
    store = dist.PrefixStore("bagua_lightning/peers/", dist.HashStore())
    return _Watch(store, 0, world_size, WatchSettings(**settings))


def _beat(watch: _Watch, rank: int, pid: int, op: str = "training") -> None:
    watch.store.set(f"hb/{rank}", f"1|{pid}|{watch.host}|{op}")


@pytest.fixture(autouse=True)
def _clean_state() -> None:
    _State.explaining = None
    yield
    _State.explaining = None


def test_a_peer_gone_without_exit_mark_is_noted_not_judged() -> None:
    """A finished rank's process ends (os._exit writes no mark): gone, yet no failure while this rank runs."""
    watch = _watch()
    _beat(watch, 1, _ended_pid())
    _beat(watch, 2, os.getpid())  # alive
    assert watch.judge() is None
    assert {r: f.how for r, f in watch.gone.items()} == {1: "died"}


def test_an_exit_mark_read_after_the_liveness_check_wins() -> None:
    watch = _watch()
    _beat(watch, 1, _ended_pid())
    watch.store.set("exit/1", "at interpreter exit")
    assert watch.judge() is None
    assert watch.gone[1].how == "exited" and "at interpreter exit" in watch.gone[1].detail


def test_a_gone_peer_fails_this_rank_when_its_collective_failed() -> None:
    watch = _watch()
    _beat(watch, 1, _ended_pid(), op="allreduce")
    _State.explaining = "wait (buckets.py:81)"
    verdict = watch.judge()
    assert verdict is not None and verdict.rank == 1 and verdict.how == "died"
    assert "rank 1 of 3 died" in verdict.detail and "allreduce" in verdict.detail
    assert "this rank's collective failed" in verdict.detail


def test_a_gone_peer_fails_this_rank_when_it_is_stuck() -> None:
    watch = _watch(stuck_s=5.0)
    _beat(watch, 1, _ended_pid())
    assert watch.judge() is None and watch.blocked is not None
    frame, line, since = watch.blocked
    watch.blocked = (frame, line, since - 6.0)  # the main thread has sat on this line for 6 s
    watch.note_main_thread = lambda now: None  # type: ignore[method-assign]  # ... and has not moved since
    verdict = watch.judge()
    assert verdict is not None and verdict.rank == 1 and "this rank has waited 6 s" in verdict.detail


def test_a_published_failure_fails_every_rank_at_once() -> None:
    watch = _watch()
    _beat(watch, 1, os.getpid())
    watch.store.set("failed", "rank 2 of 3 failed with RuntimeError: boom in <module> (x.py:3) while in training")
    assert watch.judge() == PeerFailure(rank=2, how="raised", detail=(
        "rank 2 of 3 failed with RuntimeError: boom in <module> (x.py:3) while in training"))


def test_a_silent_peer_is_gone_and_comes_back_when_it_beats_again() -> None:
    watch = _watch(dead_s=0.01)
    _beat(watch, 1, os.getpid())
    assert watch.judge() is None
    watch.seen[1] = (watch.seen[1][0], watch.seen[1][1] - 1.0)  # its heartbeat last moved 1 s ago
    assert watch.judge() is None and watch.gone[1].how == "silent"
    watch.store.set("hb/1", f"2|{os.getpid()}|{watch.host}|training")
    assert watch.judge() is None and 1 not in watch.gone


@pytest.mark.parametrize(("line", "rank", "how"), [
    ("rank 3 of 4 died (process 12 is gone, no exit mark) while in training", 3, "died"),
    ("rank 1 of 2 stopped answering (no heartbeat for 16 s, no exit: killed or hung) while in x", 1, "silent"),
    ("rank 0 (the host of the job's store) is gone (connection refused)", 0, "store"),
    ("something else", None, "raised"),
])
def test_published_lines_read_back(line: str, rank: int | None, how: str) -> None:
    assert _published(line) == PeerFailure(rank=rank, how=how, detail=line)


def test_settings_refuse_bad_values_naming_them(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"WatchSettings.stuck_s=0 must be a positive number of seconds"):
        WatchSettings(stuck_s=0)
    monkeypatch.setenv("BAGUA_LIGHTNING_PEER_DEAD_S", "soon")
    with pytest.raises(ValueError, match=r"BAGUA_LIGHTNING_PEER_DEAD_S='soon' must be a number of seconds"):
        WatchSettings.from_env()


def test_one_rank_has_no_watch() -> None:
    assert peer_watch.start(None, 0, 1) is False and peer_watch.departed() == {}
