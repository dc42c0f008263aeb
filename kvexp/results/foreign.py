"""Results other benchmark tools wrote, recognised by their shape and mapped to kvexp's levels.

Three formats, read field by field from the tools' own sources:

- `vllm bench serve --save-result` (vllm/benchmarks/serve.py): one JSON object per run of the client,
  that is one level; `--append-result` puts several on consecutive lines of one file. Files of one
  label, model and endpoint type form one run, ordered by concurrency (or rate).
- GuideLLM's `benchmarks.json` (guidellm/benchmark/schemas/report.py): a report whose `benchmarks`
  are the levels of one run.
- AIPerf's `profile_export_aiperf.json` (aiperf/exporters/json_exporter.py): one level per file, each
  metric an object of statistics in display units; files of one model, endpoint and input shape form
  one run.

Every mapped run carries `tool`, `tool_version`, `tool_notes` (how the tool's definitions differ from
kvexp's) and `not_recorded` (the level fields the tool does not record: null, never 0). Numbers are
copied as the files hold them, converted only between units (seconds to milliseconds) where the tool
writes another unit. Pure: no file I/O here; kvexp.results.store reads the files."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Optional

from kvexp.results.doc import read_levels
from kvexp.results.documents import KVCache
from kvexp.results.runs import Run

VLLM, GUIDELLM, AIPERF = "vllm-bench", "guidellm", "aiperf"
TOOL_NAMES = {VLLM: "vLLM bench serve", GUIDELLM: "GuideLLM", AIPERF: "AIPerf"}
EXPECTED = ("expected a kvexp result.json or aggregate (sweep.json, comparison.json), a vLLM `bench serve "
            "--save-result` JSON, a GuideLLM benchmarks.json or an AIPerf profile_export_aiperf.json")

# What none of the three records: server-side memory and KV telemetry, and kvexp's client self-check.
_NEVER = ("peak_vram_gib", "peak_rss_gib", "peak_server_gpu_gib", "peak_kv_cache_usage", "preemptions",
          "max_running", "max_waiting", "achieved_rate", "loop_lag_p99_ms", "client_limited")
_COMMON_NOTES = (
    "The server, its version, launch command and KV cache are not in the file: the run's backend reads "
    "\"unknown\" and its KV cache is empty.",
    "The run's prompt and output lengths are those the tool was asked for when its file records them, else "
    "the measured means rounded; a run joins the kvexp scenario with the same two lengths.",
)

NOTES = {
    VLLM: (
        "TTFT and E2E start when the client calls the HTTP request, before a connection is opened or taken "
        "from the pool, so connection set-up lands in TTFT; kvexp starts them when the request starts to go "
        "out on its connection. E2E ends at the last streamed token (kvexp: the end of the response).",
        "Output tokens are the server's usage when the stream carries it; otherwise vLLM's client "
        "re-tokenises the generated text with its own tokenizer (tokenizer_id), which can count slightly "
        "more tokens than the server produced.",
        "Throughput is output tokens / duration, timed from before the first request was issued to when "
        "the last one finished; kvexp's wall time runs from the first request sent to the last done.",
        "TPOT = (E2E − TTFT) / (output tokens − 1) per request and ITL pools the gaps between streamed "
        "chunks, as in kvexp; percentiles interpolate linearly (numpy), as in kvexp.",
        "p95 is recorded only when the run asked for it (--metric-percentiles), E2E only with "
        "--percentile-metrics including e2el; with no successful request vLLM writes 0 for every latency, "
        "read here as missing.",
    ),
    GUIDELLM: (
        "TTFT is the first streamed token − the request's start as GuideLLM's backend timed it; E2E is its "
        "request_latency (seconds, shown here in ms).",
        "TPOT here is GuideLLM's inter_token_latency_ms: (last token − first token) / (output tokens − 1) "
        "per request, where kvexp's TPOT uses the end of the response; GuideLLM's time_per_output_token_ms "
        "(which includes the first token) is not mapped. Gap-by-gap ITL is not recorded.",
        "Percentiles are read from GuideLLM's empirical distribution without interpolation (the sample at "
        "the rank); kvexp interpolates linearly between samples.",
        "Throughput is GuideLLM's time-weighted mean rate of the successful requests' output tokens over "
        "the measured window (warm-up and cool-down cut off).",
        "Output tokens are the server's usage; when the server sends none GuideLLM counts one token per "
        "streamed iteration.",
        "Requests are successful + errored; incomplete ones (cancelled when a time or count limit ended the "
        "benchmark) are left out of both counts.",
    ),
    AIPERF: (
        "TTFT is the first content response − the request's start (perf_ns); E2E is AIPerf's "
        "request_latency, whose percentiles include failed requests.",
        "TPOT here is AIPerf's inter_token_latency: (request latency − TTFT) / (output tokens − 1) per "
        "request, as kvexp's TPOT; ITL is AIPerf's inter_chunk_latency (gaps between streamed chunks).",
        "Token counts are AIPerf's own tokenizer's count of the text unless the run used "
        "--use-server-token-count (then the server's usage); this run: {token_source}.",
        "Throughput is total output tokens / benchmark duration (first request start to last response); "
        "percentiles interpolate linearly, as in kvexp.",
    ),
}
NOT_RECORDED = {
    VLLM: _NEVER + ("client_queue_p50_ms", "client_queue_p99_ms"),  # dropped below when the file has them
    GUIDELLM: _NEVER + ("itl_p50_ms", "itl_p95_ms", "itl_p99_ms", "client_queue_p50_ms", "client_queue_p99_ms"),
    AIPERF: _NEVER + ("client_queue_p50_ms", "client_queue_p99_ms"),
}


class ForeignFormatError(ValueError):
    """A file of a recognised tool that cannot be mapped; the message is one line naming the field."""


@dataclass
class ForeignLevel:
    """One level read from a foreign file, with what groups it into a run."""

    tool: str
    group: tuple[Any, ...]  # files with the same group form one run
    label: str
    model: str
    level: dict[str, Any]
    source: str
    started_at: Optional[str] = None
    version: Optional[str] = None
    notes: tuple[str, ...] = ()
    not_recorded: tuple[str, ...] = ()
    order: tuple[Any, ...] = field(default=())  # within a run: level value, then time
    asked: tuple[Optional[int], Optional[int]] = (None, None)  # prompt and output tokens asked, when recorded


# ---------------------------------------------------------------------------------------------- sniffing
def _is_vllm(doc: dict) -> bool:
    return {"completed", "duration", "request_throughput", "total_input_tokens"} <= doc.keys() and \
        ("model_id" in doc or "backend" in doc or "endpoint_type" in doc)


def _is_guidellm(doc: dict) -> bool:
    bs = doc.get("benchmarks")
    return isinstance(bs, list) and isinstance(doc.get("metadata"), dict) and \
        all(isinstance(b, dict) and isinstance(b.get("metrics"), dict) for b in bs) and \
        ("guidellm_version" in doc["metadata"] or any(b.get("type_") == "generative_benchmark" for b in bs))


_AIPERF_METRICS = ("request_throughput", "request_latency", "time_to_first_token", "request_count")


def _is_aiperf(doc: dict) -> bool:
    metric = any(isinstance(doc.get(k), dict) and "unit" in doc[k] for k in _AIPERF_METRICS)
    return metric and ("input_config" in doc or "was_cancelled" in doc or "error_summary" in doc)


def sniff(doc: Any) -> Optional[str]:
    """The tool that wrote `doc` (a parsed JSON value, or a list of them for a JSON-lines file), by its
    shape; None when it is none of the three."""
    if isinstance(doc, list):
        return VLLM if doc and all(isinstance(d, dict) and _is_vllm(d) for d in doc) else None
    if not isinstance(doc, dict):
        return None
    for tool, test in ((VLLM, _is_vllm), (GUIDELLM, _is_guidellm), (AIPERF, _is_aiperf)):
        if test(doc):
            return tool
    return None


def looks_like_kvexp(doc: Any) -> bool:
    """Whether a document claims to be one of kvexp's own (then its schema says what is wrong with it).
    A JSON value that is not an object is left to the schema's "not of type 'object'" line."""
    if not isinstance(doc, dict):
        return True
    kind = doc.get("kind")
    return (isinstance(kind, str) and kind.startswith("kvexp.")) or bool({"levels", "runs", "schema_version",
                                                                           "token_times_s"} & doc.keys())


# ---------------------------------------------------------------------------------------------- helpers
def _num(v: Any) -> Optional[float]:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return v


def _int(v: Any) -> Optional[int]:
    n = _num(v)
    return int(n) if n is not None and float(n).is_integer() else None


def _need(doc: dict, key: str, where: str, test: Callable[[Any], Any] = _num) -> Any:
    v = test(doc.get(key))
    if v is None:
        raise ForeignFormatError(f"{where}.{key}: expected a number, found {doc.get(key)!r}")
    return v


_TIME_UNITS = {"ns": 1e-6, "us": 1e-3, "µs": 1e-3, "ms": 1.0, "s": 1000.0, "sec": 1000.0, "seconds": 1000.0}


def _mean(xs: list[float]) -> Optional[float]:
    return sum(xs) / len(xs) if xs else None


def _level_base(requests: int, errors: int) -> dict[str, Any]:
    lv: dict[str, Any] = {"concurrency": None, "requests": requests, "errors": errors}
    for k in ("throughput_tok_s", "ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms", "peak_vram_gib",
              "peak_kv_cache_usage", "preemptions", "mean_prompt_tokens"):
        lv[k] = None
    return lv


def _x(concurrency: Any, rate: Any) -> tuple[Optional[int], Optional[float]]:
    """A level's concurrency (a whole number ≥ 1) or, when a finite rate was asked, its rate."""
    r = _num(rate)
    if r is not None and r > 0:
        return None, float(r)
    c = _int(concurrency)
    return (c if c is not None and c >= 1 else None), None


# ---------------------------------------------------------------------------------------------- vLLM
def vllm_level(doc: dict, source: str, where: str = "$") -> ForeignLevel:
    """One `vllm bench serve --save-result` object as one level."""
    completed = _need(doc, "completed", where, _int)
    failed = _int(doc.get("failed"))
    if failed is None:  # older clients: every prompt is sent once, so the rest failed
        n = _int(doc.get("num_prompts"))
        failed = max(0, n - completed) if n is not None else 0
    ok = completed > 0
    concurrency, rate = _x(doc.get("max_concurrency"), doc.get("request_rate"))
    if concurrency is None and rate is None:  # rate inf and no cap: every prompt at once
        concurrency = _int(doc.get("num_prompts"))
    lv = _level_base(completed + failed, failed)
    lv["concurrency"], lv["rate"] = concurrency, rate

    def stat(key: str) -> Optional[float]:
        return _num(doc.get(key)) if ok else None  # vLLM writes 0.0 when nothing succeeded

    for ours, theirs in (("ttft", "ttft"), ("tpot", "tpot"), ("itl", "itl"), ("e2e", "e2el"),
                         ("client_queue", "client_queue_time")):
        lv[f"{ours}_p50_ms"] = stat(f"median_{theirs}_ms")
        if ours != "client_queue":
            lv[f"{ours}_p95_ms"] = stat(f"p95_{theirs}_ms")
        lv[f"{ours}_p99_ms"] = stat(f"p99_{theirs}_ms")
    lv["throughput_tok_s"] = stat("output_throughput")
    lv["request_rate"] = _num(doc.get("request_throughput"))
    lv["goodput_req_s"] = _num(doc.get("request_goodput"))
    lv["wall_s"] = _num(doc.get("duration"))
    total_in, total_out = _int(doc.get("total_input_tokens")), _int(doc.get("total_output_tokens"))
    lv["mean_prompt_tokens"] = total_in / completed if ok and total_in is not None else None
    lv["mean_output_tokens"] = total_out / completed if ok and total_out is not None else None
    lv["output_tokens"] = total_out
    lv["status"] = "ok" if ok else "failed"
    lv["status_reason"] = None if ok else "no request succeeded"
    recorded = {k for k, v in lv.items() if v is not None}
    not_recorded = tuple(k for k in NOT_RECORDED[VLLM] if k not in recorded)
    model = str(doc.get("model_id") or "unknown model")
    endpoint = str(doc.get("backend") or doc.get("endpoint_type") or "")  # a run's key: text, whatever was written
    label = str(doc.get("label") or "")
    named = label if label and label != endpoint else model  # the label defaults to the endpoint type
    return ForeignLevel(VLLM, (VLLM, label, model, endpoint), named, model,
                 _compact(lv), source, _vllm_date(doc.get("date")), None, NOTES[VLLM], not_recorded,
                 (_order(lv), str(doc.get("date") or "")))


def _vllm_date(d: Any) -> Optional[str]:
    m = re.fullmatch(r"(\d{4})(\d\d)(\d\d)-(\d\d)(\d\d)(\d\d)", str(d or ""))
    return f"{m[1]}-{m[2]}-{m[3]} {m[4]}:{m[5]}" if m else None


# ---------------------------------------------------------------------------------------------- GuideLLM
def _dist(metrics: dict, key: str, status: str = "successful") -> Optional[dict]:
    d = metrics.get(key)
    d = d.get(status) if isinstance(d, dict) else None
    return d if isinstance(d, dict) and (_int(d.get("count")) or 0) > 0 else None


def _pct(d: Optional[dict], p: str, scale: float = 1.0) -> Optional[float]:
    if d is None:
        return None
    v = _num((d.get("percentiles") or {}).get(p)) if isinstance(d.get("percentiles"), dict) else None
    return None if v is None else v * scale


def guidellm_levels(doc: dict, source: str) -> list[ForeignLevel]:
    """Every benchmark of a GuideLLM report as one level of one run."""
    meta = doc.get("metadata") or {}
    version = meta.get("guidellm_version")
    out = []
    model = _guidellm_model(doc)
    for i, b in enumerate(doc["benchmarks"]):
        where = f"$.benchmarks[{i}]"
        m = b["metrics"]
        totals = m.get("request_totals")
        if not isinstance(totals, dict):
            raise ForeignFormatError(f"{where}.metrics.request_totals: expected an object, found {totals!r}")
        ok = _need(totals, "successful", f"{where}.metrics.request_totals", _int)
        errored = _need(totals, "errored", f"{where}.metrics.request_totals", _int)
        strategy = (b.get("config") or {}).get("strategy") or {}
        concurrency, rate = _guidellm_x(strategy)
        lv = _level_base(ok + errored, errored)
        lv["concurrency"], lv["rate"] = concurrency, rate
        for ours, theirs, scale in (("ttft", "time_to_first_token_ms", 1.0), ("tpot", "inter_token_latency_ms", 1.0),
                                    ("e2e", "request_latency", 1000.0)):
            d = _dist(m, theirs)
            for p in ("p50", "p95", "p99"):
                lv[f"{ours}_{p}_ms"] = _pct(d, p, scale)
        tput = _dist(m, "output_tokens_per_second")
        lv["throughput_tok_s"] = _num(tput.get("mean")) if tput else None
        rps = _dist(m, "requests_per_second")
        lv["request_rate"] = _num(rps.get("mean")) if rps else None
        prompt, output = _dist(m, "prompt_token_count"), _dist(m, "output_token_count")
        lv["mean_prompt_tokens"] = _num(prompt.get("mean")) if prompt else None
        lv["mean_output_tokens"] = _num(output.get("mean")) if output else None
        lv["output_tokens"] = _int(output.get("total_sum")) if output else None
        lv["wall_s"] = _num(b.get("duration"))
        lv["status"] = "ok" if ok else "failed"
        lv["status_reason"] = None if ok else "no request succeeded"
        started = _epoch_text(b.get("start_time"))
        out.append(ForeignLevel(GUIDELLM, (GUIDELLM, source), "guidellm", model, _compact(lv), source, started, version,
                         NOTES[GUIDELLM], NOT_RECORDED[GUIDELLM], (_order(lv), i), _guidellm_asked(doc)))
    return out


def _guidellm_x(strategy: dict) -> tuple[Optional[int], Optional[float]]:
    kind = strategy.get("type_")
    if kind == "synchronous":
        return 1, None
    if kind == "concurrent":
        return _x(strategy.get("streams"), None)
    if kind in ("constant", "poisson", "async"):
        return _x(None, strategy.get("rate"))
    return _x(strategy.get("max_concurrency") or strategy.get("streams"), strategy.get("rate"))


def _guidellm_asked(doc: dict) -> tuple[Optional[int], Optional[int]]:
    """The synthetic data's asked prompt and output tokens (`config.spec.data[]`), when that is the source."""
    for d in _obj(_obj(doc.get("config")).get("spec")).get("data") or []:
        if _obj(d).get("kind") == "synthetic_text":
            return _int(d.get("prompt_tokens")), _int(d.get("output_tokens"))
    return None, None


def _guidellm_model(doc: dict) -> str:
    """The model the report's backend was pointed at (0.8: `config.spec.backend.model`; earlier `args`)."""
    cfg = _obj(doc.get("config"))
    for holder in (_obj(_obj(cfg.get("spec")).get("backend")), _obj(cfg.get("backend")), cfg, _obj(doc.get("args"))):
        if isinstance(holder.get("model"), str) and holder["model"]:
            return holder["model"]
    return "unknown model"


def _epoch_text(t: Any) -> Optional[str]:
    v = _num(t)
    if v is None or v <= 0:
        return None
    return datetime.fromtimestamp(v, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# ---------------------------------------------------------------------------------------------- AIPerf
def _metric(doc: dict, key: str, stat: str, time: Optional[str] = None) -> Optional[float]:
    """One statistic of an AIPerf metric; with time="ms" or "s", converted from the metric's unit (a value
    already in that unit is returned unchanged)."""
    m = doc.get(key)
    if not isinstance(m, dict):
        return None
    v = _num(m.get(stat))
    if v is None or time is None:
        return v
    scale = _TIME_UNITS.get(str(m.get("unit") or "ms"))
    if scale is None:
        raise ForeignFormatError(f"$.{key}.unit: {m.get('unit')!r} is not a time unit kvexp knows "
                                 f"({', '.join(_TIME_UNITS)})")
    factor = scale if time == "ms" else scale / 1000.0
    return v if factor == 1.0 else v * factor


def aiperf_level(doc: dict, source: str) -> ForeignLevel:
    """One AIPerf profile export as one level."""
    cfg = _obj(doc.get("input_config"))
    endpoint = _obj(cfg.get("endpoint"))
    ok = _int(_metric(doc, "request_count", "avg")) or 0
    errors = _int(_metric(doc, "error_request_count", "avg"))
    if errors is None:  # AIPerf writes the error count only when a request failed
        summary = doc.get("error_summary")
        errors = sum(_int(e.get("count")) or 0 for e in summary if isinstance(e, dict)) \
            if isinstance(summary, list) else 0
    phase = _aiperf_phase(cfg)
    concurrency, rate = _x(phase.get("concurrency"), phase.get("request_rate"))
    lv = _level_base(ok + errors, errors)
    lv["concurrency"], lv["rate"] = concurrency, rate
    for ours, theirs in (("ttft", "time_to_first_token"), ("tpot", "inter_token_latency"),
                         ("itl", "inter_chunk_latency"), ("e2e", "request_latency")):
        for p in ("p50", "p95", "p99"):
            lv[f"{ours}_{p}_ms"] = _metric(doc, theirs, p, time="ms")
    lv["throughput_tok_s"] = _metric(doc, "output_token_throughput", "avg")
    lv["request_rate"] = _metric(doc, "request_throughput", "avg")
    lv["goodput_req_s"] = _metric(doc, "goodput", "avg")
    lv["wall_s"] = _metric(doc, "benchmark_duration", "avg", time="s")
    lv["mean_prompt_tokens"] = _metric(doc, "input_sequence_length", "avg")
    lv["mean_output_tokens"] = _metric(doc, "output_sequence_length", "avg")
    total = _metric(doc, "total_osl", "avg")
    lv["output_tokens"] = _int(total if total is not None else _metric(doc, "total_output_tokens", "avg"))
    lv["status"] = "ok" if ok else "failed"
    lv["status_reason"] = None if ok else "no request succeeded"
    model = _aiperf_model(cfg)
    server_counts = endpoint.get("use_server_token_count") is True
    token_source = ("the server's usage (--use-server-token-count)" if server_counts
                    else "AIPerf's tokenizer" + (f" ({_obj(cfg.get('tokenizer')).get('name')})"
                                                 if _obj(cfg.get("tokenizer")).get("name") else ""))
    if not server_counts and _metric(doc, "usage_completion_tokens", "avg") is not None:
        token_source += (f"; the server's own count (usage_completion_tokens) averaged "
                         f"{_metric(doc, 'usage_completion_tokens', 'avg'):g} tokens per request")
    notes = tuple(n.replace("{token_source}", token_source) for n in NOTES[AIPERF])
    urls = endpoint.get("urls") or endpoint.get("url") or ""
    group = (AIPERF, model, str(urls), str(endpoint.get("type") or ""), _aiperf_shape(cfg))
    started = doc.get("start_time")
    started = str(started).replace("T", " ")[:16] if isinstance(started, str) else None
    version = doc.get("aiperf_version") if isinstance(doc.get("aiperf_version"), str) else None
    return ForeignLevel(AIPERF, group, "aiperf", model, _compact(lv), source, started, version, notes,
                 NOT_RECORDED[AIPERF], (_order(lv), started or ""), _aiperf_asked(cfg))


def _obj(v: Any) -> dict:
    return v if isinstance(v, dict) else {}


def _aiperf_phase(cfg: dict) -> dict:
    """The profiling phase's load settings (AIPerf 0.13: `phases[]`; earlier: `loadgen`)."""
    for ph in cfg.get("phases") or []:
        if isinstance(ph, dict) and ph.get("kind", "profiling") == "profiling":
            return ph
    return _obj(cfg.get("loadgen"))


def _aiperf_model(cfg: dict) -> str:
    items = _obj(cfg.get("models")).get("items")
    if isinstance(items, list) and items and isinstance(items[0], dict) and items[0].get("name"):
        return str(items[0]["name"])
    names = _obj(cfg.get("endpoint")).get("model_names")
    return str(names[0]) if isinstance(names, list) and names else "unknown model"


def _aiperf_asked(cfg: dict) -> tuple[Optional[int], Optional[int]]:
    """The synthetic prompts' asked input and output lengths (their means), when the config says them."""
    for ds in cfg.get("datasets") or []:
        prompts = _obj(_obj(ds).get("prompts"))
        if prompts:
            return _int(_obj(prompts.get("isl")).get("mean")), _int(_obj(prompts.get("osl")).get("mean"))
    prompt = _obj(_obj(cfg.get("input")).get("prompt"))
    return _int(_obj(prompt.get("input_tokens")).get("mean")), _int(_obj(prompt.get("output_tokens")).get("mean"))


def _aiperf_shape(cfg: dict) -> str:
    """The asked prompt and output lengths (different shapes: different runs)."""
    for ds in cfg.get("datasets") or []:
        prompts = _obj(_obj(ds).get("prompts"))
        if prompts:
            return f"{_obj(prompts.get('isl')).get('mean')}/{_obj(prompts.get('osl')).get('mean')}"
    prompt = _obj(_obj(cfg.get("input")).get("prompt"))
    return f"{_obj(prompt.get('input_tokens')).get('mean')}/{_obj(prompt.get('output_tokens')).get('mean')}"


# ---------------------------------------------------------------------------------------------- runs
def _order(lv: dict) -> tuple[float, float]:
    if lv.get("concurrency") is not None:
        return (0, float(lv["concurrency"]))
    if lv.get("rate") is not None:
        return (1, float(lv["rate"]))
    return (2, math.inf)


def _compact(lv: dict) -> dict:
    """The level without the optional fields the tool did not give (the required ones stay, null)."""
    required = {"concurrency", "requests", "errors", "throughput_tok_s", "ttft_p50_ms", "ttft_p95_ms",
                "tpot_p50_ms", "peak_vram_gib", "peak_kv_cache_usage", "preemptions", "mean_prompt_tokens"}
    return {k: v for k, v in lv.items() if k in required or v is not None}


def levels_of(doc: Any, source: str) -> list[ForeignLevel]:
    """The levels of one parsed file (a list for a JSON-lines vLLM file); ForeignFormatError when it
    cannot be mapped."""
    tool = sniff(doc)
    try:
        if tool == VLLM:
            docs = doc if isinstance(doc, list) else [doc]
            return [vllm_level(d, source, f"$[{i}]" if isinstance(doc, list) else "$") for i, d in enumerate(docs)]
        if tool == GUIDELLM:
            if not (levels := guidellm_levels(doc, source)):
                raise ForeignFormatError("GuideLLM file with no benchmark ($.benchmarks is empty): it measured "
                                         "nothing to report")
            return levels
        if tool == AIPERF:
            return [aiperf_level(doc, source)]
    except ForeignFormatError:
        raise
    except (TypeError, AttributeError, ValueError, OverflowError, KeyError, IndexError) as e:
        # a field of a shape the mapping above does not check (a list for a name, a number for a section)
        raise ForeignFormatError(f"{TOOL_NAMES[tool]} file with a field of a shape that tool does not write "
                                 f"({type(e).__name__}: {e})") from None
    raise ForeignFormatError(EXPECTED)


def runs_of(levels: list[ForeignLevel]) -> list[Run]:
    """Levels grouped into runs of the aggregate shape (one run per tool and group), levels ordered by
    concurrency or rate; two levels at the same value become repeats 0, 1, ... in time order."""
    groups: dict[tuple[Any, ...], list[ForeignLevel]] = {}
    for lv in levels:
        groups.setdefault(lv.group, []).append(lv)
    runs = []
    for members in groups.values():
        members.sort(key=lambda x: x.order)
        count: dict[Any, int] = {}
        for m in members:
            count[m.order[0]] = count.get(m.order[0], 0) + 1
        seen: dict[Any, int] = {}
        out_levels = []
        for m in members:
            key = m.order[0]
            rep = seen[key] = seen.get(key, -1) + 1
            out_levels.append({**m.level, "repeat": rep} if count[key] > 1 else dict(m.level))
        runs.append(_run(members, out_levels))
    return runs


def _run(members: list[ForeignLevel], levels: list[dict]) -> Run:
    first = members[0]
    prompts = [lv["mean_prompt_tokens"] for lv in levels if _num(lv.get("mean_prompt_tokens")) is not None]
    outputs = [lv["mean_output_tokens"] for lv in levels if _num(lv.get("mean_output_tokens")) is not None]
    if not prompts:
        raise ForeignFormatError(f"{first.source}: no successful request in any level, so its prompt length is "
                                 "unknown")
    asked_prompt, asked_out = first.asked
    prompt = asked_prompt if asked_prompt and asked_prompt >= 1 else max(1, round(_mean(prompts) or 1))
    out = asked_out if asked_out and asked_out >= 1 else max(1, round(max(outputs))) if outputs else 1
    dates = sorted(m.started_at for m in members if m.started_at)
    not_recorded = [k for k in first.not_recorded if all(lv.get(k) is None for lv in levels)]
    if not outputs:
        not_recorded.append("mean_output_tokens")
    sources = list(dict.fromkeys(m.source for m in members))
    failed = all(lv.get("status") == "failed" for lv in levels)
    partial = any(lv.get("status") == "failed" for lv in levels)
    return Run(
        label=f"{first.tool}: {first.label if first.label != first.tool else first.model}",
        backend="unknown", model=first.model, scenario=f"prompt {prompt}, output {out}", prompt_tokens=prompt,
        max_tokens=out, started_at=dates[0] if dates else None,
        kv_cache=KVCache(present=frozenset(KVCache.REQUIRED)), levels=read_levels(levels),
        status="failed" if failed else "partial" if partial else "complete",
        status_reason="a level had no successful request" if partial else None,
        source=", ".join(sources), tool=TOOL_NAMES[first.tool], tool_version=first.version,
        tool_notes=[*first.notes, *_COMMON_NOTES], not_recorded=not_recorded)


def join_scenarios(foreign_runs: list[Run], runs: list[Run]) -> list[Run]:
    """Each foreign run takes the scenario name of the first of `runs` (kvexp's own) with the same prompt
    and output length, so that the report puts them in one table and one chart; the others keep the
    name made from their lengths. Returns `foreign_runs`, changed in place."""
    names: dict[tuple[Any, Any], str] = {}
    for r in runs:
        if not r.tool:
            names.setdefault((r.prompt_tokens, r.max_tokens), str(r.scenario))
    for r in foreign_runs:
        r.scenario = names.get((r.prompt_tokens, r.max_tokens), r.scenario)
    return foreign_runs
