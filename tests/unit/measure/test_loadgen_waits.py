"""The load generator's wait for a request's start (LoadGenerator.until): the share of each second it yields
instead of trusting a millisecond timer, on a simulated clock and on the real one (the open-loop levels
these waits serve, on the real llama-server: tests/integration/llamacpp/test_openloop.py)."""

from __future__ import annotations

import pytest


class _Streamer:
    stream_keepalive = True


class _Clock:
    """A run's clock the test drives: every reading advances it STEP_S, so that until()'s accounting sees
    the same times on any machine, however busy (a real clock also counts the time the process is off
    its core)."""

    STEP_S = 0.0001

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += self.STEP_S
        return self.t


def test_waiting_for_a_start_yields_at_most_its_share_of_each_second():
    """until() yields the last SPIN_S before a start instead of trusting a millisecond timer; at high start
    rates that would keep a core busy, so it yields at most SPIN_SHARE of each second, then rests on the
    timer until the next second begins."""
    import asyncio

    from kvexp.measure import loadgen

    async def run() -> tuple[list[bool], float, list[bool], float]:
        lg = loadgen.LoadGenerator(None, _Streamer())  # type: ignore[arg-type]
        clock = lg.now = _Clock()  # type: ignore[method-assign]

        async def starts(n: int) -> list[bool]:
            yielded = []
            for _ in range(n):  # each start due SPIN_S from now: the whole wait is the yielded stretch
                before = clock.t
                await lg.until(clock.t + loadgen.SPIN_S)
                yielded.append(clock.t - before >= loadgen.SPIN_S / 2)
            return yielded

        first = await starts(200)  # about 0.3 s of this second
        spun_first = lg.spun_s
        clock.t += 1.0  # the next second
        return first, spun_first, await starts(3), lg.spun_s

    first, spun_first, later, spun_later = asyncio.run(run())
    n = first.index(False)
    assert first == [True] * n + [False] * (200 - n)  # once the share is spent, no start yields in that second
    # the last start to yield may pass the share by its SPIN_S
    assert loadgen.SPIN_SHARE <= spun_first <= loadgen.SPIN_SHARE + loadgen.SPIN_S
    assert n == pytest.approx(loadgen.SPIN_SHARE / loadgen.SPIN_S, abs=0.1 * loadgen.SPIN_SHARE / loadgen.SPIN_S)
    assert later == [True] * 3 and 0 < spun_later <= 3 * loadgen.SPIN_S  # a new second, a new share


def test_overlapping_waits_yield_far_less_than_without_the_share(monkeypatch):
    """1,900 starts in under a second, each waiter yielding concurrently with its neighbours, on the real
    clock: with the share they yield a small part of what the same run yields without it (on a busy
    machine both grow with the time the process is off its core, so one is compared with the other)."""
    import asyncio

    from kvexp.measure import loadgen

    async def run() -> float:
        lg = loadgen.LoadGenerator(None, _Streamer())  # type: ignore[arg-type]
        start = lg.now() + 0.01
        await asyncio.gather(*(lg.until(start + i / 2000) for i in range(1900)))
        return lg.spun_s

    with monkeypatch.context() as m:
        m.setattr(loadgen, "SPIN_SHARE", float("inf"))
        unbounded = asyncio.run(run())
    spun = asyncio.run(run())
    print(f"\nyielded {spun:.3f} s with the share, {unbounded:.3f} s without")
    assert 0 < spun <= unbounded / 2
