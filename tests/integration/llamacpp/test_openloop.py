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
        job = run_job(cfg, tmp, pool=pool)
    finally:
        pool.release()
    write_job_summary(job, tmp)
    res = job.to_json()
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
