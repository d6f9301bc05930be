"""The logs the service keeps (io/servicelogs.py) stay within their bounds whatever a job
printed, oldest first out: a line, a job, all of them; a gigabyte streamed through is never
in memory at once; and the log keeper (serve/keeper.py) keeps each ended run once."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator

import pytest

from provision.core.answers import LogLine
from provision.core.events import Event, How, Kind, Stored
from provision.io.servicelogs import LogBounds, cut
from provision.io.servicestore import ServiceStore
from provision.serve.keeper import LogKeeper


@pytest.fixture
def store(tmp_path):
    s = ServiceStore.open_local(tmp_path / "service.sqlite")
    yield s
    s.close()


def printer(total: int, width: int = 64 << 10, task: str = "chief-0") -> Iterator[LogLine]:
    """A job that prints `total` bytes in lines of `width` (made as they are read)."""
    n = 0
    k = 0
    while n < total:
        text = f"{k:012d} " + "x" * (width - 14)
        yield {"time": f"2026-11-27T10:00:{k % 60:02d}Z", "task": task, "host": "gpu-1", "text": text}
        n += len(text) + 1
        k += 1


def test_a_job_that_prints_a_gigabyte_keeps_its_bound(store):
    store.log_bounds = LogBounds(line_bytes=2048, block_bytes=64 << 10, job_bytes=1 << 20, total_bytes=4 << 20)
    tracemalloc.start()
    kept = store.keep_logs("loud", 1, printer(1 << 30))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert kept <= 1 << 20
    assert store.kept_bytes() <= 1 << 20  # the job's bound, whatever it printed
    assert peak < 16 << 20, f"{peak} bytes at once"  # a ring of 1 MiB of blocks, never the gigabyte
    lines, newest = store.kept_logs("loud", 10_000)
    assert newest > 0 and lines
    # Each line cut to its bound; the last ones kept (oldest first out), in order.
    assert all(len(ln.text.encode()) <= 2048 for ln in lines) and lines[-1].text.endswith("…")
    numbers = [int(ln.text.split()[0]) for ln in lines]
    assert numbers == sorted(numbers) and numbers[-1] == (1 << 30) // (64 << 10) - 1  # its very last line
    assert {ln.run for ln in lines} == {1}


def test_all_the_kept_logs_keep_their_bound_oldest_first_out(store):
    store.log_bounds = LogBounds(line_bytes=1024, block_bytes=16 << 10, job_bytes=64 << 10, total_bytes=160 << 10)
    for j in range(5):
        store.keep_logs(f"job-{j}", 1, printer(100 << 10, 1000, f"t{j}"))
        assert store.kept_bytes() <= 160 << 10
    # The newest jobs' lines are there, the oldest ones' gone first.
    assert store.has_kept_logs("job-4") and store.has_kept_logs("job-3")
    assert not store.has_kept_logs("job-0")
    got, _ = store.kept_logs("job-4", 5)
    assert len(got) == 5 and all(ln.task == "t4" for ln in got)


def test_a_line_is_cut_at_a_character_and_holds_no_separator():
    assert cut("a\tb\nc", 100) == "a    b\\nc"
    assert cut("é" * 10, 7) == "éé…"  # 2 bytes each: two fit before the ellipsis's 3
    assert len(cut("x" * 5000, 2048).encode()) <= 2048


def ended(job: str, run: int | None, i: int) -> Stored:
    return Stored(
        i, 1000.0 + i, Event(Kind.JOB_ENDED, f"end:{job}:{run}", job, "ana", "gpu-1", "ended", How.FAILED, run)
    )


def test_the_keeper_keeps_each_ended_run_once(store):
    asked: list[tuple[str, int]] = []
    lines: list[LogLine] = [{"time": "2026-11-27T10:00:00Z", "task": "chief-0", "host": "gpu-1", "text": "boom"}]

    def tail(job: str, n: int) -> list[LogLine] | None:
        asked.append((job, n))
        return None if job == "unknown" else lines

    keeper = LogKeeper(store, tail, lambda s: None)
    started = Stored(1, 1.0, Event(Kind.JOB_STARTED, "start:bert:1", "bert", run=1))
    keeper.handle([started, ended("bert", 1, 2), ended("bert", 1, 3), ended("unknown", 1, 4), ended("bert", 2, 5)])
    assert [j for j, _ in asked] == ["bert", "unknown", "bert"]  # a repeat asks nothing; a start is no end
    assert store.kept_runs("bert") == {1, 2} and not store.has_kept_logs("unknown")
    got, _ = store.kept_logs("bert", 10)
    assert [ln.text for ln in got] == ["boom", "boom"]
