"""Open-loop rates, the in-flight cap, the start-rate cap and worker processes on the real llama-server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TINY

from kvexp.app.compose import compose
from kvexp.backends.pool import ServerPool
from kvexp.measure.loadgen import arrival_offsets
from kvexp.measure.runner import run_job
from kvexp.report.summary import write_job_summary
from kvexp.results.validate import check_file


def run(tmp: Path, binary: Path, *overrides: str) -> tuple[dict, list[dict], Path]:
    cfg = compose([*TINY, "scenario=smoke", f"backend.binary={binary}", *overrides])
    pool = ServerPool()
    try:
        res = run_job(cfg, tmp, pool=pool)
    finally:
        pool.release()
    write_job_summary(res, tmp)
    assert check_file(tmp / "result.json") == [] and check_file(tmp / "requests.jsonl") == []
    reqs = [json.loads(x) for x in (tmp / "requests.jsonl").read_text().splitlines()]
    return res, [q for q in reqs if not q["warmup"]], tmp


def in_flight(reqs: list[dict]) -> int:
    events = sorted([(q["sent_s"], 1) for q in reqs] + [(q["done_s"], -1) for q in reqs], key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, d in events:
        now += d
        most = max(most, now)
    return most


@pytest.fixture(scope="module")
def open_job(llama_server, tmp_path_factory):
    return run(tmp_path_factory.mktemp("open"), llama_server, "scenario.concurrency=[]", "scenario.rates=[8,40]", "scenario.arrival=poisson",
               "scenario.max_concurrency=2", "scenario.requests=12", "scenario.seed=3")


def test_rate_levels_follow_the_seeded_schedule(open_job):
    res, reqs, _ = open_job
    assert res["status"] == "complete" and res["scenario"]["mode"] == "open"
    assert [(lv["rate"], lv["concurrency"]) for lv in res["levels"]] == [(8, None), (40, None)]
    for lv in res["levels"]:
        assert lv["errors"] == 0 and lv["requests"] == 12
        assert lv["achieved_rate"] > 0 and lv["scheduled_rate"] > 0 and lv["client_queue_p99_ms"] is not None
        mine = sorted((q for q in reqs if q["level"] == lv["rate"]), key=lambda q: q["scheduled_s"])
        planned = arrival_offsets(12, lv["rate"], "poisson", 3)  # seed + repeat 0
        assert [q["scheduled_s"] - mine[0]["scheduled_s"] for q in mine] == pytest.approx(planned, abs=1e-9)
        assert all(q["sent_s"] >= q["scheduled_s"] - 1e-6 for q in mine)


def test_max_concurrency_caps_requests_in_flight(open_job):
    _, reqs, _ = open_job
    for rate in (8, 40):
        assert in_flight([q for q in reqs if q["level"] == rate]) <= 2


def test_reports_show_the_asked_and_achieved_rate(open_job):
    text = (open_job[2] / "summary.md").read_text()
    assert "| 8 req/s (achieved " in text and "| 40 req/s (achieved " in text


def test_max_start_rate_on_a_closed_loop(llama_server, tmp_path):
    res, reqs, _ = run(tmp_path, llama_server, "scenario.concurrency=[4]", "scenario.requests=7",
                    "scenario.max_start_rate=5")
    (lv,) = res["levels"]
    assert lv["errors"] == 0 and lv["client_queue_p99_ms"] is not None
    sent = sorted(q["sent_s"] for q in reqs)
    # five starts per second: the sixth passes the cap more than a second after the first did, which was no
    # earlier than the first request was due (sent_s is when the request went out, after the cap)
    assert sent[5] > min(q["scheduled_s"] for q in reqs) + 1.0


def test_worker_processes_on_the_real_server(llama_server, tmp_path):
    res, reqs, _ = run(tmp_path, llama_server, "client.workers=2", "scenario.concurrency=[]", "scenario.rates=[30]", "scenario.requests=10",
                    "scenario.concurrency=[2]")
    (lv,) = res["levels"]
    assert lv["errors"] == 0 and lv["client_workers"] == 2 and lv["client_cpu_util"] is not None
    env = res["environment"]["client"]
    assert env["workers"] == 2 and env["worker_processes"] and env["workers_setting"] == 2
    assert env["event_loop"].split()[0] in ("uvloop", "asyncio")
    assert len(reqs) == 10 and all(q["output_tokens"] == 16 and q["token_times_s"] for q in reqs)
    assert len({q["index"] for q in reqs}) == 10


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
