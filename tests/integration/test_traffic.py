"""The user's own traffic on the real servers: shared prefixes served from the prefix cache (and reset
between levels), multi-turn conversations whose history grows and is reused, a trace replayed on its
own schedule, a ShareGPT file, length distributions realised exactly, and bad files refused by line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY, missing, with_tiny

from kvexp.app.checks import check_config
from kvexp.app.compose import compose
from kvexp.backends.pool import ServerPool
from kvexp.core.config import ConfigError
from kvexp.measure.runner import run_job
from kvexp.results.validate import check_file

ROOT = Path(__file__).resolve().parent.parent


def run(tmp: Path, *overrides: str, pool: ServerPool | None = None) -> dict:
    cfg = compose(list(overrides))
    own = pool is None
    pool = pool or ServerPool()
    try:
        res = run_job(cfg, tmp, pool=pool)
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
    """The same lengths (512-token prompts, 32 outputs), with 2 shared prefixes of 384 tokens and without."""
    base = [f"backend.binary={llama_server}", "scenario=prefix", "scenario.requests=16"]
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
        assert s["workload"]["prompts_exact"] == s["workload"]["prompts_checked"] == 16
    # one request at a time: every request after each group's first reuses the whole prefix, and the
    # first two found nothing (the reset emptied the cache); beyond the prefix only chance matches of the
    # tiny model's few token ids
    first = shared["levels"][0]
    assert 14 * 384 <= first["prefix_cache"]["hit_tokens"] <= 14 * 384 + 16
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
    # each turn sends the previous turn's prompt, the server's answer (32 tokens, as its tokenizer reads
    # the text back) and 128 new tokens
    assert prompt[1] - prompt[0] >= 128 + 30
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


def test_llamacpp_trace_replays_on_its_own_schedule(llama_server, tmp_path, loop_lags):
    # on the job's own event loop (client.workers=1), which the test watches
    res = run(tmp_path, f"backend.binary={llama_server}", "scenario=trace", "scenario.time_scale=0.5",
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
    res = run(tmp_path, f"backend.binary={llama_server}", "scenario=sharegpt", "scenario.concurrency=[2]",
              "scenario.requests=12")
    d = res["workload"]["dataset"]
    (lv,) = res["levels"]
    assert d["entries"] + d["left_out_over_prompt_tokens"] == 40 and d["entries"] > 0
    assert lv["requests"] == 12 and lv["errors"] == 0
    lines = sorted({r["source_line"] for r in requests_of(tmp_path)})
    assert len(lines) == 12  # 12 different entries, each named by its line
    assert lv["workload"]["output_tokens"]["realised"]["max"] <= 64


def test_llamacpp_length_distribution_is_realised_exactly(llama_server, tmp_path):
    res = run(tmp_path, f"backend.binary={llama_server}", "scenario=lengths", "scenario.concurrency=[4]",
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
    base = ["backend=vllm", "scenario=prefix", "scenario.requests=16", "scenario.concurrency=[1,4]",
            '+backend.env={VLLM_SERVER_DEV_MODE: "1"}']  # one server for both jobs
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
        assert pc["hit_tokens"] == (16 - 2) * 384
        assert s["cache_reset"] == {"done": True, "how": "POST /reset_prefix_cache"}
        assert u["prefix_cache"]["hit_tokens"] == 0
        assert s["server"]["ttft_mean_ms"] < u["server"]["ttft_mean_ms"]
    # the planner holds each shared prefix once (prefix caching): its prediction is what was measured
    plan = {row["concurrency"]: row["predicted_kv_usage"] for row in shared["planner"]["levels"]}
    for lv in shared["levels"]:
        assert lv["peak_kv_cache_usage"] <= plan[lv["concurrency"]] + 0.02


def _bad(tmp: Path, name: str, lines: list[str]) -> Path:
    path = tmp / name
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = '{"conversations": [{"from": "human", "value": "hello there"}, {"from": "gpt", "value": "hi"}]}'


@pytest.mark.parametrize("bad, field", [
    ('{"conversations": [{"from": "robot", "value": "x"}]}', "conversations[0].from"),
    ('{"messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
    ("not json", "not JSON"),
    ('{"text": "x"}', '"messages", "conversations" or "prompt"'),
    ('{"prompt": "x", "output_tokens": 0}', "output_tokens"),
])
def test_every_bad_dataset_line_is_refused_with_its_number(tmp_path, bad, field):
    path = _bad(tmp_path, "d.jsonl", [GOOD, "", GOOD, bad])
    cfg = compose([*TINY, "scenario=sharegpt", f"scenario.dataset={path}"])
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    assert f"{path} line 4:" in str(e.value) and field in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("bad, field", [
    ('{"timestamp": 10, "input_length": 64}', "output_length"),
    ('{"timestamp": 10, "input_length": true, "output_length": 8}', "input_length"),
    ('{"timestamp": 1, "input_length": 64, "output_length": 8}', "timestamp"),
    ('{"timestamp": NaN, "input_length": 64, "output_length": 8}', "timestamp"),
    ('{"timestamp": 900, "input_length": 64, "output_length": 8, "hash_ids": [-1]}', "hash_ids"),
])
def test_every_bad_trace_line_is_refused_with_its_number(tmp_path, bad, field):
    good = ['{"timestamp": 0, "input_length": 64, "output_length": 8}',
            '{"timestamp": 500, "input_length": 64, "output_length": 8}']
    path = _bad(tmp_path, "t.jsonl", [*good, bad])
    cfg = compose([*TINY, "scenario=trace", f"scenario.trace={path}"])
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    assert f"{path} line 3:" in str(e.value) and field in str(e.value)


def test_a_bad_file_stops_the_cli_before_anything_runs(tmp_path):
    path = _bad(tmp_path, "d.jsonl", [GOOD, '{"conversations": [{"from": "gpt", "value": "no question"}]}'])
    out = subprocess.run([sys.executable, "-m", "kvexp", *with_tiny(["scenario=sharegpt", f"scenario.dataset={path}",
                          f"hydra.run.dir={tmp_path / 'run'}"])], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 1, out.stderr  # kvexp's status for a config that cannot run
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("kvexp:")]
    assert f"{path} line 2:" in line and "no user message" in line
    assert not (tmp_path / "run" / "result.json").exists()


@pytest.mark.parametrize("overrides, says", [
    (["scenario.prompt_dist.kind=uniform"], "scenario.prompt_dist: kind=uniform needs min and max"),
    (["scenario=prefix", "scenario.prefix_tokens=600"], "scenario.prefix_tokens=600"),
    (["scenario=multiturn", "scenario.conversation.turns=0"], "scenario.conversation.turns=0"),
    (["scenario=trace", "scenario.concurrency=[2]"], "a trace is its own schedule"),
    (["scenario=trace", "scenario.time_scale=0"], "scenario.time_scale=0"),
    (["scenario=sharegpt", "scenario.dataset=@nope"], "@nope"),
    (["scenario=multiturn", "backend.context=300", "backend.parallel=1"],
     "the scenario's longest request (prompt and output) = 480 tokens"),
    (["scenario=multiturn", "scenario.concurrency=[]", "scenario.rates=[0.5]"], "conversations run closed loop"),
    (["scenario=prefix", "scenario.prefix_groups=100"], "scenario.prefix_groups=100: more groups than the 24"),
    (["scenario=sharegpt", "scenario.prefix_tokens=100"], "scenario.dataset with scenario.prefix_tokens"),
    (["scenario=trace", "scenario.prompt_dist.kind=uniform", "scenario.prompt_dist.min=1",
      "scenario.prompt_dist.max=9"], "scenario.trace with scenario.prompt_dist"),
    (["scenario=trace", "scenario.time_scale=inf"], "scenario.time_scale=inf: must be > 0 and <= 1000"),
    (["scenario=trace", "scenario.requests=1"], "have one timestamp"),
    (["scenario=trace", "scenario.api=chat"], "replaying a trace needs token-id prompts"),
    (["scenario=trace", "scenario.trace_block_tokens=99999999"], "must be in 1..1,048,576"),
    (["scenario=sharegpt", "scenario.dataset=5"], "scenario.dataset: 5: cannot read"),
    (["scenario.prompt_dist.min=5"], "scenario.prompt_dist.min: kind=fixed does not use it"),
])
def test_bad_workload_settings_are_refused_in_one_line(overrides, says):
    with pytest.raises(ConfigError) as e:
        check_config(compose(overrides))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_json_array_file_is_named_as_such(tmp_path):
    path = _bad(tmp_path, "sharegpt.json", ['[{"conversations": [{"from": "human", "value": "hi"}]}]'])
    with pytest.raises(ConfigError) as e:
        check_config(compose([*TINY, "scenario=sharegpt", f"scenario.dataset={path}"]))
    assert "line 1: a JSON array: kvexp reads JSONL" in str(e.value) and "jq -c" in str(e.value)


def test_a_dataset_conversation_keeps_its_system_message_and_reply_lengths(tmp_path):
    """Turns of a dataset conversation, built without sending (Ollama's text prompts need no server)."""
    import asyncio

    from kvexp import backends
    from kvexp.measure.traffic import Traffic

    line = {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "one two"},
                              {"from": "gpt", "value": "x" * 40}, {"from": "human", "value": "three"},
                              {"from": "gpt", "value": "y" * 400}], "output_tokens": 7}
    longer = {"conversations": [{"from": "human", "value": w} for w in ("a", "b", "c")]}  # turns=3 is allowed
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(line) + "\n" + json.dumps(longer) + "\n")
    cfg = compose([*TINY, "backend=ollama", "backend.endpoint=http://127.0.0.1:9", "model.ollama=tiny", "scenario=sharegpt",
                   f"scenario.dataset={path}", "scenario.conversation.turns=3", "scenario.requests=1",
                   "scenario.concurrency=[1]"])
    check_config(cfg)
    backend = backends.create(cfg)

    async def turns():
        tr = Traffic(backend, None, cfg.scenario, None)
        await tr._load_dataset()
        (conv,) = (await tr.level(1, level=1, repeat=0)).conversations
        assert conv.turns == 2  # the first entry has two user messages: its own turns cap turns=3
        req0, rec0 = await conv.turn(0, None)
        rec0.text = ["an answer"]
        req1, rec1 = await conv.turn(1, rec0)
        return req0, rec0, req1, rec1

    req0, rec0, req1, rec1 = asyncio.run(turns())
    assert [m["role"] for m in req0.body["messages"]] == ["system", "user"]
    assert [m["content"] for m in req1.body["messages"]] == ["be brief", "one two", "an answer", "three"]
    assert rec0.max_tokens == 10  # the reply's length (40 characters, estimated at 4 a token)
    assert rec1.max_tokens == 7  # the entry's own output_tokens, for its last turn
    assert (rec0.turn, rec1.turn, rec0.conversation, rec1.source_line) == (0, 1, 0, 1)


def test_workload_warnings_name_what_qualifies_a_level():
    from kvexp.metrics.levels import workload_warnings

    codes = [w.code for w in workload_warnings(True, {"done": False, "how": "ollama offers no way"}, True, 3, 2, 8)]
    assert codes == ["cache_not_reset", "turns_not_sent", "entries_repeat"]
    assert workload_warnings(True, {"done": True, "how": "POST /reset_prefix_cache"}, True, 0, 40, 8) == []
    assert workload_warnings(True, None, False, 0, None, 8) == []  # nothing was sent before the first level
    assert workload_warnings(False, None, True, 0, None, 8) == []  # unique prompts: nothing to reset
