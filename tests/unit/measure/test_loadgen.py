"""The load generator against a local streaming server whose bytes and timing the test controls:
lines split across reads, errors, the start-rate cap, worker processes on one clock, the self-check,
the parser's fast path and the live progress display."""

from __future__ import annotations

import asyncio
import io
import json
import multiprocessing
import time
from typing import Any, Optional

import pytest
from conftest import FIXTURES
from aiohttp import web

from kvexp.backends import openai
from kvexp.backends.base import Request
from kvexp.core import machine
from kvexp.measure.client import ClientOptions, make_session
from kvexp.measure.eventloop import LoopLagMonitor
from kvexp.measure.loadgen import LoadGenerator, arrival_offsets
from kvexp.measure.workers import resolve_workers, runs_in_process, split_closed
from kvexp.metrics import stats
from kvexp.metrics.levels import Level
from kvexp.metrics.records import RequestRecord

FX = FIXTURES


def token(i: int, finish: str = "null") -> bytes:
    return (b'data: {"choices":[{"text":"t%d","index":0,"finish_reason":%s}],"object":"text_completion"}\n\n'
            % (i, finish.encode()))


def tail(n: int) -> bytes:
    return (b'data: {"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":%d}}\n\ndata: [DONE]\n\n' % n)


class Streamer:
    """What an adapter gives the load generator: the OpenAI SSE parser."""

    stream_keepalive = True

    def parse_line(self, line: bytes):
        return openai.parse_sse_line(line)

    def unfinished_stream(self, repeats: int):
        return f"{repeats} repeats" if repeats else None


class FakeServer:
    """aiohttp server: POST /v1/completions streams `pieces` (bytes; a float: sleep that long; a function:
    await what it returns)."""

    def __init__(self, pieces: Optional[list[Any]] = None, status: int = 200):
        self.pieces = pieces
        self.status = status
        self.received: list[float] = []  # perf_counter when each request arrived
        self.wrote: list[float] = []  # perf_counter after each piece of bytes was written

    def stream(self, n: int) -> list[Any]:
        return [token(i) for i in range(n - 1)] + [token(n - 1, '"length"'), tail(n)]

    async def handler(self, request: web.Request) -> web.StreamResponse:
        self.received.append(time.perf_counter())
        body = await request.json()
        if self.status != 200:
            return web.Response(status=self.status, text="overloaded")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for piece in self.pieces if self.pieces is not None else self.stream(int(body["max_tokens"])):
            if isinstance(piece, float):
                await asyncio.sleep(piece)
            elif callable(piece):
                await piece()
            else:
                await resp.write(piece)
                self.wrote.append(time.perf_counter())
        await resp.write_eof()
        return resp

    async def __aenter__(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handler)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()


def requests(n: int, max_tokens: int = 4) -> list[tuple[Request, RequestRecord]]:
    return [(Request("/v1/completions", {"prompt": [1, 2, 3, i], "max_tokens": max_tokens, "stream": True}),
             RequestRecord(index=i, level=1)) for i in range(n)]


async def send_one(server: FakeServer, stall_s: float = 30) -> RequestRecord:
    async with server as url, make_session(url, 4, 60, stall_s) as session:
        (req, rec), = requests(1)
        return await LoadGenerator(session, Streamer()).send(req, rec)


# ------------------------------------------------------------------------------------- the hot path
def test_lines_split_across_reads_are_joined_and_lines_of_one_read_share_a_time():
    whole = token(0) + token(1) + token(2, '"length"') + tail(3)
    cut = whole.index(b'"t1"') + 2  # in the middle of the second token's JSON
    client: list[LoadGenerator] = []

    async def first_read() -> None:  # the rest is written once the client has read the first part
        while not client[0].reads:
            await asyncio.sleep(0.001)

    server = FakeServer([whole[:cut], first_read, whole[cut:]])

    async def go() -> RequestRecord:
        async with server as url, make_session(url, 4, 60, 30) as session:
            client.append(LoadGenerator(session, Streamer()))
            (req, rec), = requests(1)
            return await client[0].send(req, rec)

    rec = asyncio.run(go())
    assert rec.ok, rec.error
    assert rec.output_tokens == 3 and rec.prompt_tokens == 4 and rec.finish_reason == "length"
    t = rec.token_times_s
    assert len(t) == 3
    rest = server.wrote[1] - client[0].origin  # when the server wrote the rest, on the client's clock
    assert t[0] < rest <= t[1]  # the second token was completed by the second read, not the first
    assert t[1] == t[2]  # the rest arrived in that same read: one timestamp
    assert rec.sent_s < rec.first_token_s == t[0] <= rec.done_s


def test_a_last_line_without_newline_is_parsed():
    rec = asyncio.run(send_one(FakeServer([token(0, '"length"'), tail(1).rstrip(b"\n")])))
    assert rec.ok, rec.error
    assert rec.output_tokens == 1


@pytest.mark.parametrize("pieces, kind, text", [
    ([token(0)], "protocol", "stream ended before its final event"),
    ([b'data: {"choices": [{"text": "a"\n\n'], "protocol", "malformed JSON"),
    ([b'data: {"error": {"message": "boom"}}\n\n'], "protocol", "server: boom"),
    ([tail(0)], "protocol", "no output token"),
    ([token(0), 2.0, tail(1)], "timeout", "stall"),
])
def test_failures_are_recorded_not_raised(pieces, kind, text):
    rec = asyncio.run(send_one(FakeServer(pieces), stall_s=0.5))
    assert rec.error_kind == kind and text in rec.error
    assert rec.done_s is not None


def test_a_stream_cut_off_after_one_token_over_and_over_says_so():
    """A server's repetition cut-off (Ollama ends a reply with no final object once a token repeats more
    than 30 times): the adapter is told how often the last token came again in a row."""
    rec = asyncio.run(send_one(FakeServer([token(0), *[token(1)] * 31])))
    assert rec.error == "stream ended before its final event: 30 repeats"
    from kvexp.backends.ollama import Ollama

    assert "token repeat limit" in Ollama.unfinished_stream(None, 30)  # type: ignore[arg-type]
    assert Ollama.unfinished_stream(None, 29) is None  # type: ignore[arg-type]


def test_http_error_status():
    rec = asyncio.run(send_one(FakeServer(status=503)))
    assert rec.error_kind == "http_status" and rec.http_status == 503 and "overloaded" in rec.error


# ------------------------------------------------------------------------------------ the parser
def _fixture_lines() -> list[bytes]:
    lines = []
    for f in sorted(FX.rglob("*")):
        if f.is_file() and f.suffix in (".txt", ".sse") and "sse" in f.name + f.suffix:
            lines += f.read_bytes().splitlines()
    return lines


CRAFTED = [
    b'data: {"usage":{"prompt_tokens":123456789012345678901234567890}}',  # beyond 64 bits
    b'data: {"choices":[{"text":"a","finish_reason":123456789012345678901234567890}]}',
    b'data: {"error":{"message":123456789012345678901234567890}}',
    b'data: {"choices":[{"text":NaN}]}', b'data: {"choices":[{"text":"\\ud800"}]}',
    b'data: {"choices":[{"text":"\xff"}]}', b'data: \xef\xbb\xbf{"choices":[{"text":"b"}]}',
    b'data: {"a":1,"a":2,"choices":[{"text":"q"}]}', b'data: {"choices":[{"text":1e400}]}',
    b'data: ' + b'[' * 950 + b']' * 950, b'data: {"choices":[{"delta":{"content":null}}]}',
    b'data: {"choices":[{"delta":{"role":"assistant","content":"x"}}]}', b'data: {"choices":[{"text":""}]}',
]


def _outcome(line: bytes) -> str:
    try:
        return repr(openai.parse_sse_line(line))
    except Exception as e:  # the old parser raised on some inputs: so must the new one
        return type(e).__name__


def test_fast_parser_reads_exactly_what_json_reads(monkeypatch):
    lines = _fixture_lines() + CRAFTED
    lines += [ln[:k] for ln in lines[:60] for k in (7, len(ln) // 2, len(ln) - 1)]  # truncated lines
    assert len(lines) > 100
    fast = [_outcome(ln) for ln in lines]
    monkeypatch.setattr(openai, "_fast_loads", json.loads)  # the plain json reading
    openai._TOKEN_EVENTS.clear()
    assert [_outcome(ln) for ln in lines] == fast


def test_token_events_are_shared_and_frozen():
    a = openai.parse_sse_line(token(0))
    b = openai.parse_sse_line(token(0))
    assert a is b and a.content and a.text == "t0"
    with pytest.raises(Exception):
        a.text = "x"  # type: ignore[misc]


# -------------------------------------------------------------------------- open loop, start-rate cap
def test_arrival_schedules_are_seeded():
    assert arrival_offsets(4, 2.0, "constant", 0) == [0.0, 0.5, 1.0, 1.5]
    a, b = arrival_offsets(200, 10.0, "poisson", 7), arrival_offsets(200, 10.0, "poisson", 7)
    assert a == b and a != arrival_offsets(200, 10.0, "poisson", 8)
    assert all(x < y for x, y in zip(a, a[1:]))
    assert 5.0 < 199 / a[-1] < 20.0  # about 10 per second


def test_open_loop_records_schedule_and_client_queue():
    async def go():
        async with FakeServer([0.2, token(0, '"length"'), tail(1)]) as url, make_session(url, 8, 60, 30) as s:
            lg = LoadGenerator(s, Streamer())
            return await lg.run_level(requests(4), offsets_s=[0.0, 0.0, 0.0, 0.3], max_concurrency=1)

    run = asyncio.run(go())
    recs = run.records
    assert all(r.ok for r in recs)
    # one place: the second request waits for the first to end (the server holds each 200 ms), the third
    # for the second
    waits = [r.sent_s - r.scheduled_s for r in recs]
    assert recs[1].sent_s >= recs[0].done_s and recs[2].sent_s >= recs[1].done_s
    # the second, due with the first, waited at least the first's whole time on the server
    assert waits[1] >= recs[0].done_s - recs[0].sent_s
    assert 0 < waits[1] < waits[2]
    assert recs[3].scheduled_s - recs[0].scheduled_s == pytest.approx(0.3)
    assert stats.start_rate(recs, scheduled=True) == pytest.approx(10.0)


def test_max_start_rate_caps_request_starts():
    async def go():
        async with FakeServer() as url, make_session(url, 8, 60, 30) as s:
            return await LoadGenerator(s, Streamer()).run_level(requests(7), concurrency=7, max_start_rate=5.0)

    recs = asyncio.run(go()).records
    sent = sorted(r.sent_s for r in recs)
    assert all(r.ok for r in recs)
    # five starts per one-second window: the sixth passes the cap more than a second after the first did,
    # which was no earlier than the first request was due (sent_s is when the request went out, after the cap)
    assert sent[5] > min(r.scheduled_s for r in recs) + 1.0
    assert all(r.scheduled_s is not None for r in recs)  # the wait is client-side queueing


# ------------------------------------------------------------------------------------ worker processes
def _child_clock(q: Any) -> None:
    q.put(time.perf_counter())


def test_perf_counter_is_one_clock_across_processes():
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    before = time.perf_counter()
    p = ctx.Process(target=_child_clock, args=(q,))
    p.start()
    theirs = q.get(timeout=60)
    p.join(30)
    assert before < theirs < time.perf_counter()


def test_closed_loop_split_over_workers():
    shares = split_closed(10, 5, 2)
    assert [s for s, _ in shares] == [3, 2]
    assert sorted(i for _, idx in shares for i in idx) == list(range(10))
    assert [len(idx) for _, idx in shares] == [6, 4]
    assert split_closed(8, 1, 4) == [(1, list(range(8)))]  # one stream: one worker


def test_auto_workers(monkeypatch):
    monkeypatch.setattr(machine, "usable_cpus", lambda: 16)
    assert resolve_workers("auto", 64) == 1 and resolve_workers("auto", 65) == 2
    assert resolve_workers("auto", 10_000) == 14  # two cores left: the server's CPU side and the job's process
    assert not runs_in_process("auto", 1, "auto")  # cores to spare: a measuring process of its own
    assert runs_in_process(1, 1, "auto") and not runs_in_process(1, 1, "uvloop")
    monkeypatch.setattr(machine, "usable_cpus", lambda: 2)
    assert resolve_workers("auto", 1024) == 1 and runs_in_process("auto", 1, "auto")
    assert resolve_workers(3, 1) == 3 and not runs_in_process(3, 3, "auto")


class Counting:
    def __init__(self) -> None:
        self.done: list[RequestRecord] = []

    def level_started(self, level: float, total: int, repeat: int) -> None: pass
    def level_done(self, level: float, summary: dict[str, Any]) -> None: pass

    def request_done(self, record: RequestRecord) -> None:
        self.done.append(record)


def test_workers_share_a_level_on_one_clock():
    server = FakeServer([0.05, token(0), 0.02, token(1, '"length"'), tail(2)])
    seen = Counting()

    async def go():
        async with server as url, make_session(url, 8, 60, 30) as s:
            lg = LoadGenerator(s, Streamer(), seen)
            opts = ClientOptions(base_url=url, max_connections=8, request_timeout_s=60, stall_timeout_s=30,
                                 workers=2, event_loop="asyncio")
            try:
                await asyncio.sleep(1.0)  # a clock started apart from the parent's would be off by this much
                t0 = lg.now()
                run = await lg.run_level(requests(12), concurrency=4, options=opts)
                t1 = lg.now()
                again = await lg.run_level(requests(4), offsets_s=[0.0, 0.01, 0.02, 0.03], options=opts)
            finally:
                lg.close()
            return lg, run, again, t0, t1

    lg, run, again, t0, t1 = asyncio.run(go())
    assert run.workers == 2 and not run.in_process and run.event_loop == "asyncio"
    assert len(run.cpu_util) == 2 and run.loop_lag_p99_ms is not None
    recs = run.records
    assert [r.index for r in recs] == list(range(12))
    assert all(r.ok and r.output_tokens == 2 and len(r.token_times_s) == 2 for r in recs), recs[0].error
    # the workers' times are on the parent's clock: inside the window the parent saw, and each
    # request reached the server after it was sent
    assert all(t0 < r.sent_s < r.first_token_s <= r.done_s < t1 for r in recs)
    # and the server's own clock (perf_counter in this process) agrees: each request arrived after its
    # worker sent it and before its first token came back (a worker clock started apart from the
    # parent's would be off by the second slept above, beyond the 50 ms the server holds a request)
    got = sorted(server.received)[:12]
    sent = sorted(lg.origin + r.sent_s for r in recs)
    first = sorted(lg.origin + r.first_token_s for r in recs)
    assert all(s < g < f for s, g, f in zip(sent, got, first))
    assert len(seen.done) == 12 + 4  # progress came back for every request
    assert len(again.records) == 4 and all(r.ok for r in again.records)
    assert again.records[3].scheduled_s - again.records[0].scheduled_s == pytest.approx(0.03)
    assert not lg._pools  # closed: no worker left


def test_uvloop_worker_takes_a_level_larger_than_a_pipe_buffer():
    pytest.importorskip("uvloop")

    async def go():
        async with FakeServer([token(0, '"length"'), tail(1)]) as url, make_session(url, 8, 60, 30) as s:
            lg = LoadGenerator(s, Streamer())
            opts = ClientOptions(base_url=url, max_connections=8, request_timeout_s=60, stall_timeout_s=30,
                                 workers=1, event_loop="uvloop")
            reqs = requests(40)
            for req, _ in reqs:
                req.body["prompt"] = list(range(4000))  # about 800 kB of requests for the worker
            try:
                return await lg.run_level(reqs, concurrency=8, options=opts)
            finally:
                lg.close()

    run = asyncio.run(go())
    assert not run.in_process and run.workers == 1 and run.event_loop.startswith("uvloop")
    assert all(r.ok for r in run.records)


def test_connection_errors_in_workers_are_recorded_per_request():
    async def go():
        async with make_session("http://127.0.0.1:9", 4, 5, 5) as s:
            lg = LoadGenerator(s, Streamer())
            opts = ClientOptions(base_url="http://127.0.0.1:9", max_connections=4, request_timeout_s=5,
                                 stall_timeout_s=5, workers=2, event_loop="auto")
            return await lg.run_level(requests(2), concurrency=2, options=opts)

    run = asyncio.run(go())  # nothing listens on port 9: connection errors, recorded per request
    assert [r.error_kind for r in run.records] == ["connection", "connection"]


# ------------------------------------------------------------------------------------- self-check
def test_loop_lag_monitor_sees_a_blocked_loop():
    async def go():
        with LoopLagMonitor() as lag:
            await asyncio.sleep(0.03)
            t = time.perf_counter()
            time.sleep(0.08)  # the loop is blocked: every timestamp taken now is late
            blocked = time.perf_counter() - t
            await asyncio.sleep(0.03)
        return lag, blocked

    lag, blocked = asyncio.run(go())
    # the sample that spans the block wakes at least (block - interval) late, and the p99 of these few
    # samples (about 7) lies at or above the second largest: the block shows in it
    assert max(lag.lags_s) >= blocked - lag.interval_s
    assert lag.p99_ms() >= sorted(lag.lags_s)[-2] * 1000


def test_client_limits():
    assert stats.client_limits(1.0, 10.0, [0.5]) == []
    assert stats.client_limits(None, None, []) == []
    assert "lagged 6 ms" in stats.client_limits(6.0, 10.0, [0.5])[0]
    assert stats.client_limits(6.0, 20.0, [0.5]) == []  # under half an ITL of 20 ms
    assert "busy 95 %" in stats.client_limits(1.0, 10.0, [0.2, 0.95])[0]


# ------------------------------------------------------------------------------------- progress
def test_live_progress_counts_and_draws_on_its_own_timer():
    from rich.console import Console

    from kvexp.app.progress import LiveProgress, make_observer

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=200)
    p = make_observer("job-a", "plain", repeats=2, console=console)
    assert isinstance(p, LiveProgress)
    assert make_observer("job-a", "plain", console=Console(file=io.StringIO())) == "plain"  # not a terminal
    p.level_started(16, 8, 1)
    drawn = len(out.getvalue())
    for i in range(5):
        r = RequestRecord(index=i, level=16, output_tokens=10)
        if i == 4:
            r.output_tokens, r.error_kind = None, "timeout"
        p.request_done(r)
    assert len(out.getvalue()) == drawn  # request_done only counts
    snap = p.snapshot()
    assert (snap["done"], snap["total"], snap["errors"]) == (5, 8, 1) and snap["tok_s"] > 0
    assert snap["remaining_s"] is not None
    console.print(p)
    assert "5/8 requests" in out.getvalue() and "repeat 2/2" in out.getvalue()
    p.level_done(16, Level.from_json({"throughput_tok_s": 12.5, "ttft_p50_ms": 3, "tpot_p50_ms": 1, "errors": 1,
                                      "requests": 8, "status": "ok", "client_limited": False}))
    assert p.live is None and "12.5 tok/s" in out.getvalue()
