"""State shared across threads and streams: plan caches, last-block tickets and the launch
recording, driven from many threads at once on the CPU (the GPU suite repeats the tickets with
real streams and kernels: tests/test_dispatch_gpu.py)."""

import array
import threading

import pytest

from cupyloss._core import args as _args, dispatch as _dispatch, engine as _engine, plans as _plans


def _together(n, body):
    """body(i) on n threads started at one barrier; the exceptions they raised."""
    start, errors = threading.Barrier(n), []

    def run(i):
        start.wait()
        try:
            body(i)
        except Exception as exc:     # reported to the test, which fails on any
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_a_full_plan_cache_takes_inserts_from_many_threads():
    """Eviction from a full cache under concurrent inserts: no KeyError, never more than its
    size, every thread's last plan readable right after its insert."""
    cache = _plans.Plans(size=8)

    def body(i):
        for k in range(20000):
            cache[(i, k)] = k
            assert len(cache) <= 8

    assert _together(8, body) == []
    assert len(cache) == 8


@pytest.fixture
def fake_tickets(monkeypatch):
    """Ticket chunks at fake addresses (no GPU): each chunk 1 << 32 apart."""
    chunks = []

    def zeroed(device, size):
        chunks.append(size)
        return len(chunks) << 32

    monkeypatch.setattr(_engine, "_zeroed", zeroed)
    monkeypatch.setattr(_engine, "TICKETS", {})
    monkeypatch.setattr(_engine, "_CHUNKS", {})
    return chunks


def test_no_two_streams_share_a_ticket(fake_tickets):
    """2,500 streams from 8 threads at once (past the 1,024 of one chunk): every stream's ticket
    and column tickets its own, the same on every later call, none overlapping another's."""
    streams = list(range(1000, 3500))

    def body(i):
        for s in streams[i::8]:
            _engine.ticket(0, s)
            _engine.col_tickets(0, s)

    assert _together(8, body) == []
    tickets = {s: _engine.ticket(0, s) for s in streams}
    cols = {s: _engine.col_tickets(0, s) for s in streams}
    assert len(set(tickets.values())) == len(streams)
    spans = sorted((c, c + 4 * _engine.COL_TICKETS) for c in cols.values())
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert not set(tickets.values()) & {a for c, e in spans for a in range(c, e, 4)}
    assert len(fake_tickets) == 3                       # 2,500 streams: three chunks
    assert _engine.ticket(1, streams[0]) not in tickets.values()   # devices apart


def test_recording_takes_this_threads_launches_only(monkeypatch):
    """A recording on one thread leaves other threads' launches real, and two threads may record
    at once, each getting its own launches."""
    made = []

    class Driver:
        @staticmethod
        def launchKernel(function, *rest):
            made.append((threading.get_ident(), function))

    monkeypatch.setattr(_args, "_driver", Driver)
    words = array.array("Q", [1, 2])
    got = {}

    def body(i):
        if i < 4:
            region = _dispatch.Region([], 0, 0, 0, dry=True)
            with _dispatch.recording(region) as ops:
                for _ in range(200):
                    _args.launch(100 + i, (1,), (32,), 0, 0, words)
            got[i] = ops
        else:
            for _ in range(200):
                _args.launch(100 + i, (1,), (32,), 0, 0, words)

    assert _together(8, body) == []
    for i in range(4):
        assert len(got[i]) == 200 and {op[1] for op in got[i]} == {100 + i}
    assert sorted({f for _, f in made}) == [104, 105, 106, 107] and len(made) == 800
    assert _args.RECORDING.ops is None


def test_recordings_nest():
    outer_region = _dispatch.Region([], 0, 0, 0, dry=True)
    inner_region = _dispatch.Region([], 0, 0, 0, dry=True)
    words = array.array("Q", [0])
    with _dispatch.recording(outer_region) as outer:
        _args.launch(1, (1,), (1,), 0, 0, words)
        with _dispatch.recording(inner_region) as inner:
            _args.launch(2, (1,), (1,), 0, 0, words)
        _args.launch(3, (1,), (1,), 0, 0, words)
    assert [op[1] for op in outer] == [1, 3] and [op[1] for op in inner] == [2]
