"""Typed documents at the file boundary (kvexp/results/documents.py, runs.py, metrics/levels.py): what is read
is written back as it was, one Run type for every source, what a run is lives on the run, and nothing above
results/ opens a run's JSON."""

from __future__ import annotations

import ast
import copy
import json
from pathlib import Path

import pytest

from conftest import FIXTURES, ROOT

from kvexp.analysis.aggregate import collect
from kvexp.metrics.levels import Level
from kvexp.results.blocks import Plan, Quality
from kvexp.results.documents import JobResult, KVCache
from kvexp.results.runs import SLO, Aggregate, Run
from kvexp.results.validate import read_errors

REFERENCE = FIXTURES / "planner" / "rtx5070ti-qwen2.5-7b.json"
REAL = FIXTURES / "decision"
V1 = FIXTURES / "foreign" / "kvexp" / "result.json"  # a real job of schema_version 1 (text warnings)
PKG = ROOT / "kvexp"


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_the_reference_document_is_written_back_as_it_was_read():
    ref = _json(REFERENCE)
    agg = Aggregate.from_json(copy.deepcopy(ref))
    assert agg.to_json() == ref
    assert all(isinstance(r, Run) and all(isinstance(lv, Level) for lv in r.levels) for r in agg.runs)
    # the reference's runs record no status and no warnings: complete, and their warnings are not recorded
    assert {r.state for r in agg.runs} == {"complete"} and agg.runs[0].status is None
    assert not any(lv.warnings_recorded for r in agg.runs for lv in r.levels)


@pytest.mark.parametrize("name", ["fp16", "q8_0", "cpu-fp16", "cpu-q8_0-q4_0"])
def test_a_job_result_is_written_back_as_it_was_read(name):
    doc = _json(REAL / name / "result.json")
    job = JobResult.from_json(copy.deepcopy(doc))
    assert job.to_json() == doc
    assert job.backend.name == doc["backend"]["name"] and job.kv_cache.dtype == doc["kv_cache"]["dtype"]
    assert [lv.x for lv in job.levels] == [("concurrency", float(lv["concurrency"])) for lv in doc["levels"]]


def test_a_field_set_on_a_read_document_is_written_and_the_keys_it_lacked_stay_out():
    doc = _json(REAL / "fp16" / "result.json")
    del doc["status_reason"], doc["workload"]
    job = JobResult.from_json(copy.deepcopy(doc))
    job.update(status="failed", status_reason="cancelled by Slurm")
    out = job.to_json()
    assert (out["status"], out["status_reason"]) == ("failed", "cancelled by Slurm") and "workload" not in out
    assert {k: v for k, v in out.items() if k not in ("status", "status_reason")} == \
        {k: v for k, v in doc.items() if k != "status"}


def test_a_read_result_made_the_codes_own_writes_what_is_set_on_it_and_its_blocks():
    doc = _json(REAL / "fp16" / "result.json")
    job = JobResult.from_json(copy.deepcopy(doc)).own()
    job.resumed_at, job.backend.log_tail = ["2026-12-07T20:00:00Z"], "last words"
    out = job.to_json()
    assert out["resumed_at"] == ["2026-12-07T20:00:00Z"] and out["backend"]["log_tail"] == "last words"
    def within(read, written):  # what was read is written again, beside the fields now written as null
        if isinstance(read, dict):
            return all(k in written and within(v, written[k]) for k, v in read.items())
        if isinstance(read, list):
            return len(read) == len(written) and all(within(a, b) for a, b in zip(read, written))
        return read == written
    assert within(doc, out) and read_errors(out, "result") == []
    assert out["search"] is None and "log_tail" not in doc["backend"]


def test_a_result_built_in_code_writes_every_field_null_where_unknown_but_those_its_schema_forbids_null():
    out = JobResult(label="x", kv_cache=KVCache(dtype="f16")).to_json()
    assert out["search"] is None and out["quality"] is None and out["kv_cache"]["blocks"] is None
    assert "resumed_at" not in out and "timing" not in out and "source" not in out["kv_cache"]


def test_a_job_is_one_run_of_the_aggregate_shape_and_validates():
    job = JobResult.from_json(_json(REAL / "q8_0" / "result.json"))
    run = Run.of_job(job, "x/result.json")
    out = run.to_json()
    assert set(out) >= {"label", "backend", "model", "scenario", "prompt_tokens", "max_tokens", "started_at", "gpu",
                        "kv_cache", "levels", "status", "backend_version", "launch_command", "variable_length",
                        "kv_requested", "weights", "placement", "reused_server", "planner", "source"}
    assert out["backend"] == "llamacpp" and out["started_at"].endswith(" UTC") and "T" not in out["started_at"][:16]
    assert set(out["kv_cache"]) >= set(KVCache.REQUIRED)
    assert set(out["weights"]) == {"weights_format", "bits_per_weight", "params_b", "origin"}
    assert read_errors({"gpu": None, "gpu_gib": None, "runs": [out]}, "aggregate") == []
    # what the run is, read off the run
    assert (run.kv.name, run.kv.source, run.kv.note) == ("q8_0", "requested", "rotated")
    assert run.kind == "llama.cpp, q8_0 KV" and run.weights_text == "GGUF Q4_1, 5.74 bits/weight"
    assert run.bytes_per_token == 12240 and run.exposes("throughput_tok_s") and run.kv_confirmed
    assert run.objectives is None and run.state == "complete"


def test_a_schema_version_1_result_still_reads_its_text_warnings():
    job = JobResult.from_json(_json(V1))
    lv = job.levels[0]
    assert lv.warnings_recorded and [w.code for w in lv.warnings] == ["warn"] * len(lv.warnings)
    assert lv.warnings[0].text == "only 16 requests: percentiles are rough"
    agg = collect([V1])  # the aggregate of it validates, its warnings written back as the file has them
    assert agg.runs[0].to_json()["levels"] == _json(V1)["levels"]


def test_other_tools_runs_are_the_same_run_type_and_say_what_they_do_not_hold():
    agg = collect([FIXTURES / "foreign" / "vllm"])
    (run,) = agg.runs
    assert isinstance(run, Run) and run.foreign and run.tool == "vLLM bench serve"
    assert run.kv.name is None and run.kind == "unknown" and run.weights_text == "—"
    assert not run.exposes("peak_kv_cache_usage") and "peak_kv_cache_usage" in run.not_recorded
    out = run.to_json()
    assert out["kv_cache"] == {"dtype": None, "blocks": None, "block_size": None, "gpu_memory_utilization": None}
    assert "itl_p50_ms" in out["levels"][0] and "peak_rss_gib" not in out["levels"][0]  # only what the file held


def test_what_a_run_calls_its_kv_dtype():
    assert Run(kv_requested="fp8").kv.name == "fp8"
    assert Run(kv_cache=KVCache(dtype_k="q8_0", dtype_v="q4_0")).kv.name == "q8_0/q4_0"
    label = Run(label="vllm-fp8kv-chat").kv
    assert (label.name, label.source, label.display) == ("fp8", "label", "fp8†")
    assert Run(label="plain").kv.display == "—"
    quantised = Run(kv_requested="q4_0", kv_cache=KVCache(rotation_k=False, rotation_v=False))
    assert quantised.kv.display == "q4_0 (not rotated)"
    assert Run(kv_requested="fp8", numerics={"kv_scales": "computed at load"}).kv.note == "scales computed"


def test_a_runs_objectives_are_its_searchs_else_its_own():
    own = {"slo_ttft_ms": 100.0, "slo_tpot_ms": None, "percentile": "p99"}
    run = Run.from_json({"label": "a", "slo": own})
    assert run.objectives == SLO(100.0, None, "p99") and run.objectives.to_json() == own
    searched = Run.from_json({"label": "a", "slo": own, "search": {"objectives": {"slo_tpot_ms": 5.0}}})
    assert searched.objectives == SLO(None, 5.0, "p95")
    assert Run.from_json({"label": "a", "slo": {"slo_ttft_ms": None, "slo_tpot_ms": None}}).objectives is None


def test_repeats_merge_into_one_level_by_their_kinds_of_figure():
    def lv(rep, tput, peak, requests=10, status="ok"):
        return {"concurrency": 4, "repeat": rep, "status": status, "requests": requests, "errors": 1,
                "throughput_tok_s": tput, "peak_vram_gib": peak, "ttft_p50_ms": 10.0 * (rep + 1)}

    run = Run.from_json({"label": "a", "levels": [lv(0, 100.0, 2.0), lv(1, 200.0, 3.0),
                                                   lv(2, 900.0, 9.0, status="failed"),
                                                   {"concurrency": 1, "requests": 5, "errors": 0}]})
    one, four = run.merged_levels()
    assert one.x == ("concurrency", 1.0) and one.repeat_throughputs is None
    assert (four.requests, four.errors, four.throughput_tok_s, four.peak_vram_gib, four.ttft_p50_ms) == \
        (20, 2, 150.0, 3.0, 15.0)  # sums of counts, means, maxima of peaks; the failed repeat left out
    assert four.repeat_throughputs == (100.0, 200.0) and run.level_at(("concurrency", 4.0)) == four
    assert run.levels[0].to_json() == lv(0, 100.0, 2.0)  # the levels as recorded are untouched


def test_a_level_reads_its_figures_by_registry_key():
    lv = Level.from_json({"concurrency": None, "rate": 2.5, "server": {"tpot_p50_ms": 3.0}, "errors": 0})
    assert lv.x == ("rate", 2.5) and lv.value("server.tpot_p50_ms") == 3.0 and lv.number("server.queue_mean_ms") is None
    assert lv.value("cv") is None and lv.value("no_such_key") is None  # not a level field: nothing to read
    assert lv.kv_usage_samples is None and lv.client_limited is None  # not recorded: unknown, never 0
    assert lv.keys() == ["concurrency", "rate", "errors", "server"]
    deep = Level.from_json({"workload": {"arrival_error_ms": {"p99": 1.5}}, "repeats": {"throughput_tok_s": None}})
    assert deep.value("workload.arrival_error_ms.p99") == 1.5 and deep.value("repeats.throughput_tok_s.n") is None


def _exact(doc: dict, made: dict) -> bool:
    """The same JSON text: the same keys in the same order, the same values."""
    return json.dumps(doc) == json.dumps(made)


def test_a_producers_block_is_written_back_as_it_was_read_unknown_keys_and_order_included():
    doc = _json(REAL / "cpu-fp16" / "result.json")
    doc["planner"] = {"zz_new": {"a": 1}, **doc["planner"], "memory_measure": "rss"}
    del doc["planner"]["calibrated"], doc["planner"]["inputs"]["kv_dtype"]  # keys an older planner did not write
    doc["quality"]["continuation"], doc["quality"]["later_figure"] = None, 0.5
    doc["workload"] = {**doc["workload"], "prompt_dist": {"kind": "normal", "centre": 8, "mean": 8.4, "new": 1}}
    doc["search"] = {"kind": "concurrency", "answer": 4, "objectives": {"slo_ttft_ms": 100.0}, "next_field": []}
    job = JobResult.from_json(copy.deepcopy(doc))
    assert job.to_json() == doc
    for out in (job.to_json(), JobResult.from_json(copy.deepcopy(doc)).own().to_json()):  # (own: a resumed job)
        assert all(_exact(out[k], doc[k]) for k in ("planner", "quality", "workload", "search"))
    p, q = job.planner, job.quality
    assert isinstance(p, Plan) and p.calibrated is None and p.inputs is not None and p.inputs.kv_dtype is None
    assert p.levels[0].concurrency == doc["planner"]["levels"][0]["concurrency"] and p.memory_measure == "rss"
    assert isinstance(q, Quality) and not q.continuation and q.continuation.identical_share is None  # null: empty
    assert q.deepest is not None and q.deepest.context == max(d["context"] for d in doc["quality"]["teacher_forced"]
                                                              ["depths"] if d["status"] == "ok")
    assert job.workload is not None and job.workload.prompt_dist.varies and job.search is not None
    run = Run.of_job(job, "x/result.json")
    assert run.objectives == SLO(100.0, None) and run.search is job.search
    back = Aggregate.from_json(json.loads(json.dumps({"runs": [run.to_json()]}))).runs[0].to_json()
    assert all(_exact(back[k], doc[k]) for k in ("planner", "quality", "workload", "search"))


def test_an_aggregates_blocks_are_written_back_as_they_were_read():
    ref = _json(REFERENCE)
    ref["planner"]["models"]["new-preset"] = {"n_layers": 2, "n_kv_heads": 1, "head_dim": 8, "rope": "x"}
    ref["calibration"][0] = {"note": "an unknown key first", **ref["calibration"][0]}
    del ref["calibration"][-1]["preset"]
    ref["environment"] = {"cpu": "a CPU", "hostname": "h", "new": [1]}
    agg = Aggregate.from_json(copy.deepcopy(ref))
    out = agg.to_json()
    assert out == ref and all(_exact(out[k], ref[k]) for k in ("planner", "calibration", "environment"))
    assert agg.planner is not None and agg.planner.models["new-preset"].dims == (2, 1, 8)
    assert agg.calibration and agg.calibration[-1].preset is None and agg.environment.cpu == "a CPU"


# A block of a result, a run, an aggregate or a level (the attribute a read goes through): none is read off a
# mapping above results/ (Level's own module, metrics/levels.py, makes a level's blocks). Their classes are
# results/blocks.py's, documents.py's and runs.py's; a level's nested blocks are read with Level.value.
BLOCKS = ("planner", "quality", "search", "workload", "environment", "timing", "calibration", "verdicts",
          "recommendations", "kv_cards", "inputs", "calibrated", "cpu_memory", "teacher_forced", "continuation",
          "determinism", "baseline", "prompt_dist", "output_dist", "models", "numerics", "placement", "repeats",
          "machine", "prefix_cache", "cache_reset", "server", "delivery")


def _block_of(node: ast.AST) -> str | None:
    """The block an expression reads: `run.planner`, `(run.planner or {})`."""
    while isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
        node = node.values[0]
    return node.attr if isinstance(node, ast.Attribute) and node.attr in BLOCKS else None


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Names bound to a block (`p = run.planner or {}`, `timing, env = res.timing, res.environment`)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
            pairs = zip(target.elts, value.elts) if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) \
                else [(target, value)]
            out.update({t.id: block for t, v in pairs if isinstance(t, ast.Name) and (block := _block_of(v))})
    return out


def _block_reads(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    aliases = _aliases(tree)
    out = []
    for node in ast.walk(tree):
        seen = None
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and node.args and isinstance(node.args[0], ast.Constant)):
            seen = node.func.value
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.ctx, ast.Load):
            seen = node.value  # (a producer writes its block's keys: the runner, the environment's)
        block = None if seen is None else (aliases.get(seen.id) if isinstance(seen, ast.Name) else _block_of(seen))
        if block:
            out.append(f"{path.relative_to(PKG.parent)}:{node.lineno} reads {block!r} off a mapping")
    return out


def test_blocks_are_read_by_attribute_above_results():
    paths = [p for p in sorted([*PKG.rglob("*.py"), *(ROOT / "hydra_plugins").rglob("*.py")])
             if p.parent != PKG / "results" and p != PKG / "metrics" / "levels.py"]
    bad = [m for path in paths for m in _block_reads(path)]
    assert not bad, "a block read as JSON above results/ (read it by attribute):\n" + "\n".join(bad)


# Keys only a run of an aggregate, a job result or a level has: reading one of these off a mapping above
# results/ means a run or a level travels as JSON again, past its type (the runner and the quality
# measurement included: they fill and read a typed JobResult).
RUN_KEYS = ("kv_requested", "kv_cache", "runs", "tool_notes", "backend_version", "launch_command",
            "variable_length", "reused_server", "config_hash", "status_reason", "finished_at", "resumed_at",
            "peak_rss_gib", "kv_usage_samples", "client_limited")
TYPED = ("analysis", "planning", "report", "app", "measure", "quality")


def _json_reads(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            key = node.slice.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and node.args and isinstance(node.args[0], ast.Constant)):
            key = node.args[0].value
        if key in RUN_KEYS:
            out.append(f"{path.relative_to(PKG.parent)}:{node.lineno} reads {key!r}")
    return out


def test_runs_are_read_by_attribute_above_results():
    bad = [m for pkg in TYPED for path in sorted((PKG / pkg).rglob("*.py")) for m in _json_reads(path)]
    assert not bad, "a run read as JSON above results/ (read it by attribute):\n" + "\n".join(bad)
