"""The user's own traffic on the real servers: shared prefixes served from the prefix cache (and reset
between levels), multi-turn conversations whose history grows and is reused, a trace replayed on its
own schedule, a ShareGPT file and length distributions realised exactly (bad files and settings, refused
before anything runs: tests/unit/workload/test_traffic_files.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import missing

from kvexp.app.compose import compose
from kvexp.backends.pool import ServerPool
from kvexp.measure.runner import run_job
from kvexp.results.validate import check_file


def run(tmp: Path, *overrides: str, pool: ServerPool | None = None) -> dict:
    cfg = compose(list(overrides))
    own = pool is None
    pool = pool or ServerPool()
    try:
        res = run_job(cfg, tmp, pool=pool).to_json()
    finally:
        if own:
            pool.release()
    assert check_file(tmp / "result.json") == []
    assert res["status"] == "complete", res["status_reason"]
    return res


def requests_of(tmp: Path) -> list[dict]:
    return [r for line in (tmp / "requests.jsonl").read_text().splitlines() if not (r := json.loads(line))["warmup"]]


@pytest.fixture(scope="module")
def prefix_runs(llama_server, tmp_path_factory):
    """The same lengths (512-token prompts, 8 outputs: the prefix is prefill's), with 2 shared prefixes of
    384 tokens and without."""
    base = [f"backend.binary={llama_server}", "scenario=prefix", "scenario.requests=8", "scenario.max_tokens=8"]
    return (run(tmp_path_factory.mktemp("shared"), *base),
            run(tmp_path_factory.mktemp("unique"), *base, "scenario.prefix_tokens=0"))


def test_llamacpp_shared_prefix_is_reused_and_faster(prefix_runs):
    shared, unique = prefix_runs
    assert shared["workload"]["kind"] == "shared prefix" and shared["workload"]["server_prompt_cache"]
    assert unique["workload"]["kind"] == "synthetic" and not unique["workload"]["server_prompt_cache"]
    for s, u in zip(shared["levels"], unique["levels"]):
        print(f"\nc={s['concurrency']}: TTFT p50 {s['ttft_p50_ms']} ms shared vs {u['ttft_p50_ms']} ms unique; "
              f"reused {s['prefix_cache']}; reset: {s['cache_reset']['how']}")
        assert s["prefix_cache"]["hit_tokens"] > 0 and s["prefix_cache"]["hit_rate"] > 0
        assert u["prefix_cache"]["hit_tokens"] == 0
        assert s["cache_reset"]["done"] and "erased" in s["cache_reset"]["how"]
        assert s["workload"]["prompts_exact"] == s["workload"]["prompts_checked"] == 8
    # one request at a time: every request after each group's first reuses the whole prefix, and the
    # first two found nothing (the reset emptied the cache); beyond the prefix only chance matches of the
    # tiny model's few token ids
    first = shared["levels"][0]
    assert 6 * 384 <= first["prefix_cache"]["hit_tokens"] <= 6 * 384 + 16
    assert first["ttft_p50_ms"] < unique["levels"][0]["ttft_p50_ms"]


def test_llamacpp_conversation_history_grows_and_is_reused(llama_server, tmp_path):
    # as many conversations as slots: with more, a conversation's idle slot (its think time) may be
    # given to another, and its next turn finds no history to reuse (measured, not a fault)
    res = run(tmp_path, f"backend.binary={llama_server}", "scenario=multiturn", "scenario.concurrency=[2]",
              "scenario.requests=2", "scenario.conversation.think_time_s=0.05")
    (lv,) = res["levels"]
    turns = lv["turns"]
    print("\nturns:", turns)
    assert [t["turn"] for t in turns] == [0, 1, 2] and all(t["requests"] == 2 and not t["errors"] for t in turns)
    prompt = [t["mean_prompt_tokens"] for t in turns]
    assert prompt[0] == 128 and prompt[0] < prompt[1] < prompt[2]
    # each turn sends the previous turn's prompt, the server's answer as its tokenizer reads the text back
    # (no more than the tokens it generated; often fewer, where the text it wrote merges into longer
    # tokens: 24 of 32 was seen) and 128 new tokens
    assert prompt[1] - prompt[0] > 128
    assert turns[0]["mean_cached_tokens"] == 0
    assert turns[1]["mean_cached_tokens"] >= 128 and turns[2]["mean_cached_tokens"] >= prompt[1] * 0.9
    # the cache never held more than the planner's bound for the longest turn (its history at full length)
    (row,) = res["planner"]["levels"]
    assert lv["peak_kv_cache_usage"] <= row["predicted_kv_usage_max"] + 0.02
    assert row["predicted_kv_usage"] < row["predicted_kv_usage_max"]
    assert not any(w["code"] == "kv_above_plan" for w in lv["warnings"])
    recs = requests_of(tmp_path)
    # a turn is sent no earlier than the previous turn of its conversation ended
    by_conv: dict[int, list[dict]] = {}
    for r in recs:
        by_conv.setdefault(r["conversation"], []).append(r)
    for rs in by_conv.values():
        rs.sort(key=lambda r: r["turn"])
        assert all(b["sent_s"] >= a["done_s"] for a, b in zip(rs, rs[1:]))
        assert all(r["prompt_tokens"] == r["target_prompt_tokens"] for r in rs)
        # the history grew by the answer the server counted, read back by its own tokenizer
        assert all(0.5 * a["output_tokens"] <= b["prompt_tokens"] - a["prompt_tokens"] - 128 <= a["output_tokens"] + 1
                   for a, b in zip(rs, rs[1:]))


def test_llamacpp_trace_replays_on_its_own_schedule(llama_server, tmp_path, loop_lags):
    # on the job's own event loop (client.workers=1), which the test watches
    res = run(tmp_path, f"backend.binary={llama_server}", "model=tiny", "scenario=trace", "scenario.time_scale=0.5",
              "client.workers=1")
    (lv,) = res["levels"]
    w = lv["workload"]
    print(f"\ntrace x0.5: {lv['rate']} req/s, arrival error {w['arrival_error_ms']}, reuse {lv['prefix_cache']}, "
          f"loop lag p99 {lv['loop_lag_p99_ms']} ms, max {max(loop_lags.lags, default=0) * 1000:.1f} ms")
    assert res["workload"]["trace"]["rows"] == 64 and lv["requests"] == 64 and lv["errors"] == 0
    # each request sent at its time in the trace, late by no more than the client's own loop was stalled; the
    # 5 ms p99 target is bench/traffic.py's (figures in docs/loadgen.md): a busy machine can delay any send
    recs = requests_of(tmp_path)
    loop_lags.check_sends(recs)
    assert w["arrival_error_ms"]["max"] == pytest.approx(max(r["sent_s"] - r["scheduled_s"] for r in recs) * 1000,
                                                         abs=0.01)
    assert w["prompts_exact"] == 64 and w["output_tokens"]["realised"] == w["output_tokens"]["asked"]
    assert lv["prefix_cache"]["hit_tokens"] > 0  # rows that share hash ids share their first blocks
    from kvexp.workload import files, trace

    rows = trace.load_trace(files.resolve_path("@trace-tiny.jsonl"))
    recs = sorted(recs, key=lambda r: r["index"])
    start = recs[0]["scheduled_s"]
    for row, r in zip(rows, recs):  # the schedule is the trace's own, scaled
        assert r["scheduled_s"] - start == pytest.approx((row.timestamp_s - rows[0].timestamp_s) * 0.5, abs=1e-6)
        assert (r["prompt_tokens"], r["output_tokens"]) == (row.input_length, row.output_length)


def test_llamacpp_sharegpt_file_runs(llama_server, tmp_path):
    res = run(tmp_path, f"backend.binary={llama_server}", "model=tiny", "scenario=sharegpt", "scenario.concurrency=[2]",
              "scenario.requests=12")
    d = res["workload"]["dataset"]
    (lv,) = res["levels"]
    assert d["entries"] + d["left_out_over_prompt_tokens"] == 40 and d["entries"] > 0
    assert lv["requests"] == 12 and lv["errors"] == 0
    lines = sorted({r["source_line"] for r in requests_of(tmp_path)})
    assert len(lines) == 12  # 12 different entries, each named by its line
    assert lv["workload"]["output_tokens"]["realised"]["max"] <= 64


def test_llamacpp_length_distribution_is_realised_exactly(llama_server, tmp_path):
    res = run(tmp_path, f"backend.binary={llama_server}", "model=tiny", "scenario=lengths", "scenario.concurrency=[4]",
              "scenario.requests=24")
    recs = requests_of(tmp_path)
    asked = [r["target_prompt_tokens"] for r in recs]
    assert len(set(asked)) > 10 and min(asked) >= 32 and max(asked) <= 1024
    assert all(r["prompt_tokens"] == r["target_prompt_tokens"] for r in recs)
    assert all(r["output_tokens"] == r["max_tokens"] for r in recs)
    assert len({r["max_tokens"] for r in recs}) > 5
    w = res["levels"][0]["workload"]
    assert w["prompt_tokens"]["asked"] == w["prompt_tokens"]["realised"]
    assert sum(b["count"] for b in w["prompt_histogram"]) == 24
    assert not any(x["code"] in ("prompt_length", "output_length") for x in res["levels"][0]["warnings"])
    assert res["workload"]["prompt_dist"]["kind"] == "lognormal"


@pytest.mark.vllm
def test_vllm_shared_prefix_hits_from_its_counters(tmp_path):
    from kvexp.assets.install import vllm_python

    if vllm_python() is None:
        missing("the vLLM CPU venv", "run `python -m kvexp install vllm`")
    # kvexp's tiny model: what is checked is vLLM's own counters and the planner's prediction (vLLM's CPU
    # build takes ~13 s to prefill SmolLM2's 512 tokens here); that reuse makes the first token sooner is
    # checked on SmolLM2 with llama-server (test_llamacpp_shared_prefix_is_reused_and_faster)
    base = ["backend=vllm", "model=tiny", "scenario=prefix", "scenario.requests=8", "scenario.concurrency=[1,4]",
            "scenario.max_tokens=4", '+backend.env={VLLM_SERVER_DEV_MODE: "1"}']  # one server for both jobs
    pool = ServerPool()
    try:
        shared = run(tmp_path / "shared", *base, pool=pool)
        unique = run(tmp_path / "unique", *base, "scenario.prefix_tokens=0", pool=pool)
    finally:
        pool.release()
    assert unique["backend"]["reused_server"]
    for s, u in zip(shared["levels"], unique["levels"]):
        pc = s["prefix_cache"]
        print(f"\nvLLM c={s['concurrency']}: {pc}; server TTFT mean {s['server']['ttft_mean_ms']} ms shared vs "
              f"{u['server']['ttft_mean_ms']} ms unique; KV usage {s['peak_kv_cache_usage']}")
        assert "prefix_cache_hits_total" in pc["source"] and pc["hit_rate"] > 0
        # the reset before each level: only each group's first request misses its 3 full blocks of 128
        assert pc["hit_tokens"] == (8 - 2) * 384
        assert s["cache_reset"] == {"done": True, "how": "POST /reset_prefix_cache"}
        assert u["prefix_cache"]["hit_tokens"] == 0
    # the planner holds each shared prefix once (prefix caching): its prediction is what was measured
    plan = {row["concurrency"]: row["predicted_kv_usage"] for row in shared["planner"]["levels"]}
    for lv in shared["levels"]:
        assert lv["peak_kv_cache_usage"] <= plan[lv["concurrency"]] + 0.02
