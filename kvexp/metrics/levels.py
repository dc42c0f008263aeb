"""One measured level as a typed record, and the warnings that qualify its numbers.

A `Level` carries the reference document's output names (ms, GiB, tok/s; null: unknown or not
exposed). A `LevelWarning` is {code, text, values}: findings and reports read the code and the values,
the text is for people. The thresholds behind the warnings live here, once; findings.py uses the same
ones when it checks documents that carry no warnings of their own."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional, Sequence

from kvexp.metrics import stats
from kvexp.metrics.registry import is_num

MIN_REQUESTS = 20  # fewer requests than this: percentiles are rough
SPREAD_RATIO = 3.0  # TTFT p95 above this x p50: a wide spread
MAX_CV = stats.UNSTABLE_CV  # coefficient of variation across repeats at or above this: unstable
MIN_KV_SAMPLES = 5  # fewer KV-usage samples than this: the peak is a lower bound
RATE_SHORTFALL = 0.9  # an open-loop level that started fewer than this share of its scheduled rate
PLAN_USAGE_MARGIN = 0.02  # measured KV usage above the planner's prediction by more than this: flagged
TPOT_AGREEMENT = 0.10  # client and server TPOT p50 further apart than this (a fraction): flagged

# code -> what it means, for report legends
WARNING_CODES = {
    "errors": "some requests failed",
    "few_requests": f"fewer than {MIN_REQUESTS} requests",
    "prompt_length": "prompts of another length than asked",
    "output_length": "outputs of another length than asked",
    "ttft_spread": f"TTFT p95 > {SPREAD_RATIO:g} × p50",
    "kv_undersampled": f"KV usage sampled fewer than {MIN_KV_SAMPLES} times",
    "client_limited": "client-limited",
    "rate_shortfall": "requests started slower than scheduled",
    "unstable": f"CV ≥ {MAX_CV * 100:.0f} % across repeats",
    "bursts": "server streamed in bursts: client TPOT/ITL reflect delivery",
    "kv_usage_implied": "preemptions imply a full KV cache (samples saw less)",
    "kv_above_plan": f"KV usage above the planner's prediction (+{PLAN_USAGE_MARGIN * 100:.0f} %)",
    "tpot_disagrees": f"client and server TPOT differ by > {TPOT_AGREEMENT * 100:.0f} %",
    "server_queueing": "requests waited in the server's queue",
    "cache_not_reset": "the server's cache was not reset before the level: it may reuse earlier prompts",
    "turns_not_sent": "conversations ended early: turns after a failed one were not sent",
    "entries_repeat": "the dataset has fewer entries than the level's requests: entries repeat",
}


# code -> the short mark a report's table cell carries (the code itself where none is listed)
TAGS = {"few_requests": f"n<{MIN_REQUESTS}", "ttft_spread": "spread", "unstable": "cv", "client_limited": "client"}


@dataclass(frozen=True)
class LevelWarning:
    code: str  # one of WARNING_CODES
    text: str
    values: dict[str, Any] = field(default_factory=dict)
    plain: bool = field(default=False, compare=False)  # read from a schema_version 1 file: its text alone

    def to_json(self) -> Any:
        """{code, text, values}; a warning read as plain text (schema_version 1) is written back as it was."""
        return self.text if self.plain else {"code": self.code, "text": self.text, "values": dict(self.values)}


@dataclass(slots=True)
class Level:
    """One level of one job (a concurrency or a rate, one repeat), as result.json stores it: built by the
    runner while it measures, or read from a document (from_json: kvexp's result.json, an aggregate, or
    another tool's level mapped onto kvexp's keys). Read by attribute everywhere above results/."""

    concurrency: Optional[int]
    rate: Optional[float]
    repeat: Optional[int]
    status: Optional[str]  # ok | failed (None: the document does not say, which reads as ok)
    requests: Optional[int]
    errors: Optional[int]
    errors_by_kind: Optional[dict[str, int]]
    throughput_tok_s: Optional[float]
    request_rate: Optional[float]
    ttft_p50_ms: Optional[float]
    ttft_p95_ms: Optional[float]
    ttft_p99_ms: Optional[float]
    tpot_p50_ms: Optional[float]
    tpot_p95_ms: Optional[float]
    tpot_p99_ms: Optional[float]
    itl_p50_ms: Optional[float]
    itl_p95_ms: Optional[float]
    itl_p99_ms: Optional[float]
    e2e_p50_ms: Optional[float]
    e2e_p95_ms: Optional[float]
    e2e_p99_ms: Optional[float]
    client_queue_p50_ms: Optional[float]
    client_queue_p99_ms: Optional[float]
    wall_s: Optional[float]
    mean_prompt_tokens: Optional[float]
    mean_output_tokens: Optional[float]
    output_tokens: Optional[int]
    peak_vram_gib: Optional[float] = None
    peak_server_gpu_gib: Optional[float] = None
    peak_rss_gib: Optional[float] = None
    peak_kv_cache_usage: Optional[float] = None
    kv_usage_samples: Optional[int] = 0  # None: a document that does not record it (another tool's)
    preemptions: Optional[float] = None
    max_running: Optional[int] = None
    max_waiting: Optional[int] = None
    loop_lag_p99_ms: Optional[float] = None
    client_workers: Optional[int] = None
    client_cpu_util: Optional[float] = None
    client_limited: Optional[bool] = False  # None: a document that does not record it
    goodput_req_s: Optional[float] = None
    achieved_rate: Optional[float] = None
    scheduled_rate: Optional[float] = None
    status_reason: Optional[str] = None
    repeats: Optional[dict[str, Any]] = None
    # the server's own timing of the same requests (stats.server_view_*), and how tokens arrived
    server: Optional[dict[str, Any]] = None
    delivery: Optional[dict[str, Any]] = None
    machine: Optional[dict[str, Any]] = None  # the machine's load over the level (core.machine.load_view)
    kv_usage_sampled_peak: Optional[float] = None  # set when preemptions prove a higher peak than sampled
    # the workload as asked and as the server counted it (stats.workload_view), the server's prefix
    # cache over the level (Adapter.prefix_cache), whether it was reset before, and per-turn figures
    workload: Optional[dict[str, Any]] = None
    prefix_cache: Optional[dict[str, Any]] = None
    cache_reset: Optional[dict[str, Any]] = None
    turns: Optional[list[dict[str, Any]]] = None
    predicted_kv_usage: Optional[float] = None  # the planner's, where a document records it per level
    warnings: list[LevelWarning] = field(default_factory=list)
    # not written: the throughput of each repeat, on a level that merges its repeats (Level.merge)
    repeat_throughputs: Optional[tuple[float, ...]] = field(default=None, repr=False, compare=False)
    # the keys of the document the level was read from (None: built by the runner); to_json writes these
    present: Optional[frozenset[str]] = field(default=None, repr=False, compare=False)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Level":
        """A level as a document holds it (kvexp's result.json, or another tool's level mapped onto kvexp's
        keys): what it lacks is None (unknown), keys no field names are ignored; recorded warnings keep
        their code, text and values (a plain-text warning of schema_version 1 gets the code "warn")."""
        kw: dict[str, Any] = {n: d.get(n) for n in _LEVEL_KEYS if n != "warnings"}
        kw["warnings"] = [LevelWarning(str(w.get("code") or "warn"), str(w.get("text", "")),
                                       dict(w.get("values") or {}))
                          if isinstance(w, dict) else LevelWarning("warn", str(w), plain=True)
                          for w in d.get("warnings") or []]
        return cls(**kw, present=frozenset(k for k in d if k in _LEVEL_KEY_SET))

    def to_json(self) -> dict[str, Any]:
        """The level as a document holds it: a level read from one writes back the keys it was read with;
        one the runner built writes every figure (null: unknown), the optional blocks only where they apply."""
        if self.present is not None:
            out = {k: getattr(self, k) for k in _LEVEL_KEYS if k in self.present}
            if "warnings" in out:
                out["warnings"] = [w.to_json() for w in self.warnings]
            return out
        out = {k: getattr(self, k) for k in _LEVEL_KEYS}
        out["warnings"] = [w.to_json() for w in self.warnings]
        for key in ("achieved_rate", "scheduled_rate", "status_reason", "repeats", "kv_usage_sampled_peak",
                    "cache_reset", "turns", "predicted_kv_usage"):
            if out[key] is None:  # only where they apply (open loop, a failed level, the last repeat)
                del out[key]
        return out

    def keys(self) -> list[str]:
        """The keys the level's document holds (to_json's), in field order."""
        if self.present is not None:
            return [k for k in _LEVEL_KEYS if k in self.present]
        return list(self.to_json())

    @property
    def x(self) -> Optional[tuple[str, float]]:
        """Where the level sits: ("concurrency", c) closed loop, ("rate", r) open loop, None when it names
        neither (another tool's level may not)."""
        for kind in ("concurrency", "rate"):
            v = getattr(self, kind)
            if is_num(v):
                return (kind, float(v))
        return None

    @property
    def failed(self) -> bool:
        return self.status == "failed"

    @property
    def warnings_recorded(self) -> bool:
        """Whether the document recorded the level's warnings (kvexp's own do; the reference document and
        other tools' files do not, and analysis makes them from the figures: figure_warnings)."""
        return self.present is None or "warnings" in self.present

    @property
    def warning_codes(self) -> set[str]:
        return {w.code for w in self.warnings}

    def value(self, key: str) -> Any:
        """A figure by registry key; a dotted key reads a nested block ("server.tpot_p50_ms",
        "workload.arrival_error_ms.p99")."""
        head, *rest = key.split(".")
        v = getattr(self, head) if head in _LEVEL_KEY_SET else None
        for part in rest:
            v = v.get(part) if isinstance(v, dict) else None
        return v

    def number(self, key: str) -> Optional[float]:
        """A figure as a float (None: missing, or not a finite number)."""
        v = self.value(key)
        return float(v) if is_num(v) else None

    @classmethod
    def merge(cls, group: Sequence["Level"]) -> "Level":
        """Repeats of one level as one: sums of counts, maxima of peaks, means of everything else (the
        failed ones left out unless every one failed); repeat_throughputs holds each repeat's throughput."""
        ok = [lv for lv in group if not lv.failed] or list(group)
        if len(ok) == 1:
            return ok[0]
        changes: dict[str, Any] = {}
        for key in _LEVEL_KEYS:
            vals = [float(v) for lv in ok if is_num(v := getattr(lv, key))]
            if key in ("concurrency", "rate", "repeat") or not vals:
                continue
            if key in _SUM_KEYS:
                changes[key] = sum(vals)
            elif key.startswith("peak_") or key in _MAX_KEYS:
                changes[key] = max(vals)
            else:
                changes[key] = statistics.fmean(vals)
        if is_num(changes.get("errors")):
            changes["errors"] = int(changes["errors"])
        present = None if any(lv.present is None for lv in ok) else frozenset().union(*(lv.present for lv in ok))
        return replace(ok[0], **changes, present=present,
                       repeat_throughputs=tuple(float(lv.throughput_tok_s) for lv in ok if is_num(lv.throughput_tok_s)))


_LEVEL_KEYS = tuple(f.name for f in fields(Level) if f.name not in ("present", "repeat_throughputs"))
_LEVEL_KEY_SET = frozenset(_LEVEL_KEYS)
_SUM_KEYS = {"requests", "errors", "preemptions", "output_tokens"}
_MAX_KEYS = {"max_running", "max_waiting", "loop_lag_p99_ms"}


def level_x(level: dict[str, Any]) -> Optional[tuple[str, float]]:
    """Where a level of a result document's JSON sits (the runner's and the file readers' view; a typed
    Level has its own `x`): ("concurrency", c) closed loop, ("rate", r) open loop,
    None when it names neither (another tool's level may not)."""
    for kind in ("concurrency", "rate"):
        if is_num(level.get(kind)):
            return (kind, float(level[kind]))
    return None


def workload_warnings(reuses: bool, cache_reset: Optional[dict[str, Any]], after_others: bool,
                      unsent_turns: int, entries: Optional[int], requests: int) -> list[LevelWarning]:
    """What qualifies a level of a workload that reuses prompts: a cache that was not emptied before it
    (after_others: the server had served the job's warm-up or an earlier level), turns not sent, dataset
    entries sent more than once."""
    w: list[LevelWarning] = []
    if reuses and after_others and not (cache_reset or {}).get("done"):
        how = (cache_reset or {}).get("how") or "scenario.reset_cache=false"
        w.append(LevelWarning("cache_not_reset", f"the server's prefix cache was not reset before this level ({how}): "
                              "its hits may include prompts sent before it", {"how": how}))
    if unsent_turns:
        w.append(LevelWarning("turns_not_sent", f"{unsent_turns} turns were not sent: each conversation ends at its "
                              "first failed turn", {"turns": unsent_turns}))
    if entries is not None and entries < requests:
        w.append(LevelWarning("entries_repeat", f"{requests} requests from {entries} dataset entries: entries repeat "
                              "within the level", {"entries": entries, "requests": requests}))
    return w


def kv_peak(sampled: Optional[float], preemptions: Optional[float]) -> tuple[Optional[float], Optional[float]]:
    """(peak KV usage to report, the sampled peak when the report differs from it). A server preempts
    only when no free block is left, so a level with preemptions had a full cache whatever the samples
    saw: a gauge never contradicts the counter."""
    if preemptions and (sampled or 0.0) < 1.0:
        return 1.0, sampled
    return sampled, None


def figure_warnings(level: Level, client_limits: Optional[Sequence[str]] = None) -> list[LevelWarning]:
    """The checks a level's own figures allow: failed requests, too few requests, a wide TTFT spread, a
    client that may have limited it (client_limits: what the load generator saw; None: only the
    level's client_limited flag is known). The runner makes them while measuring (level_warnings);
    analysis/flags.py makes them for a document's levels that carry no warnings of their own."""
    w: list[LevelWarning] = []
    if level.errors:
        w.append(LevelWarning("errors", f"{level.errors:g} of {level.requests:g} requests failed",
                              {"errors": level.errors, "requests": level.requests}))
    if level.requests is not None and level.requests < MIN_REQUESTS:
        w.append(LevelWarning("few_requests", f"only {level.requests:g} requests: percentiles are rough",
                              {"requests": level.requests, "min_requests": MIN_REQUESTS}))
    p50, p95 = level.ttft_p50_ms, level.ttft_p95_ms
    if p50 and p95 and p95 > SPREAD_RATIO * p50:
        w.append(LevelWarning("ttft_spread", f"wide TTFT spread: p95 {p95:.1f} ms is over {SPREAD_RATIO:g}x "
                              f"p50 {p50:.1f} ms", {"ttft_p50_ms": p50, "ttft_p95_ms": p95}))
    if client_limits or (client_limits is None and level.client_limited):
        why = "; ".join(client_limits) + ": the client" if client_limits else "the client"
        # The likely cause decides the advice: a client process busy for most of a core is short of
        # processes (more workers help); a late event loop in a mostly idle client waited for cores the
        # machine gave to others (the server on the same cores), which more workers would only crowd.
        busy_share = 0.5
        cpu = level.client_cpu_util
        if cpu is None:
            advice = "set client.workers if the client was busy, else the machine was loaded"
        elif cpu >= busy_share:
            advice = "set client.workers for more client processes"
        else:
            advice = (f"the client process was busy only {cpu * 100:.0f} % of a core, so the machine was loaded: "
                      "the server shares the cores with the client, and more client workers would not help")
        w.append(LevelWarning("client_limited", f"{why} may have limited this level ({advice})",
                              {"loop_lag_p99_ms": level.loop_lag_p99_ms, "client_cpu_util": level.client_cpu_util}))
    return w


def level_warnings(level: Level, done: Sequence[Any], forced: bool,
                   client_limits: Sequence[str] = (), predicted_kv_usage: Optional[float] = None,
                   held_back_by: Optional[str] = None) -> list[LevelWarning]:
    """What qualifies a level's numbers. done: its successful requests (records.RequestRecord), whose
    realised lengths are checked against the ones each asked, where the backend forces them (a prompt
    only where its length was exact by construction); predicted_kv_usage: the planner's prediction for
    this level, the truth its measured KV usage is checked against; held_back_by: what the scenario
    itself caps an open loop with (max_concurrency, max_start_rate)."""
    w = figure_warnings(level, client_limits)
    if forced:
        prompt = [(r.prompt_tokens, r.target_prompt_tokens) for r in done
                  if r.target_prompt_tokens is not None and r.prompt_tokens is not None]
        output = [(r.output_tokens, r.max_tokens) for r in done if r.max_tokens is not None]
        for code, pairs, what in (("prompt_length", prompt, "a prompt length"), ("output_length", output,
                                                                                  "an output length")):
            bad = [asked for got, asked in pairs if got != asked]
            if bad:
                asked = sorted({a for _, a in pairs})
                said = f"{asked[0]} tokens" if len(asked) == 1 else "the one it asked for"
                w.append(LevelWarning(code, f"{len(bad)} requests had {what} other than {said}",
                                      {"requests": len(bad), "asked": asked[0] if len(asked) == 1 else None}))
    if level.peak_kv_cache_usage is not None and level.kv_usage_samples < MIN_KV_SAMPLES:
        w.append(LevelWarning("kv_undersampled", f"KV usage was sampled only {level.kv_usage_samples} times "
                              "in this level: its peak is a lower bound", {"samples": level.kv_usage_samples}))
    if level.kv_usage_sampled_peak is not None or (level.preemptions and level.kv_usage_samples == 0):
        w.append(LevelWarning("kv_usage_implied", f"{level.preemptions:g} preemptions: the KV cache was full "
                              f"(peak shown as 100 %; the samples saw {_pct(level.kv_usage_sampled_peak)})",
                              {"preemptions": level.preemptions, "sampled_peak": level.kv_usage_sampled_peak}))
    peak = level.peak_kv_cache_usage
    if peak is not None and predicted_kv_usage is not None and peak > predicted_kv_usage + PLAN_USAGE_MARGIN \
            and not level.preemptions:
        w.append(LevelWarning("kv_above_plan", f"peak KV usage {_pct(peak)} is above the planner's "
                              f"{_pct(predicted_kv_usage)}: the server holds more than the requests need, or the "
                              "plan describes another cache", {"peak": peak, "predicted": predicted_kv_usage}))
    d = level.delivery or {}
    server_p50 = level.value("server.tpot_p50_ms")
    server_tpot = server_p50 or level.value("server.tpot_mean_ms")
    if level.value("delivery.bursts"):
        w.append(LevelWarning("bursts", f"server streamed in bursts ({d['tokens_per_chunk']:g} tokens per chunk, "
                              f"{d['multi_token_chunk_share'] * 100:.0f} % of chunks multi-token): client TPOT/ITL "
                              "reflect delivery, not decoding" + (f"; the server's TPOT is {server_tpot:g} ms"
                                                                  if server_tpot else ""),
                              {"tokens_per_chunk": d["tokens_per_chunk"],
                               "multi_token_chunk_share": d["multi_token_chunk_share"], "server_tpot_ms": server_tpot}))
    elif server_p50 and level.tpot_p50_ms and abs(level.tpot_p50_ms - server_p50) > TPOT_AGREEMENT * server_p50:
        # median against median: a server that reports only a mean is not compared with the client's median
        w.append(LevelWarning("tpot_disagrees", f"client TPOT p50 {level.tpot_p50_ms:g} ms and the server's "
                              f"p50 {server_p50:g} ms differ by more than {TPOT_AGREEMENT * 100:.0f} %",
                              {"client_tpot_p50_ms": level.tpot_p50_ms, "server_tpot_ms": server_p50}))
    if level.rate is not None and level.max_waiting:
        w.append(LevelWarning("server_queueing", f"up to {level.max_waiting} requests waited in the server's queue: "
                              "its slots, not the client, held them back", {"max_waiting": level.max_waiting}))
    planned, achieved = level.scheduled_rate, level.achieved_rate
    if planned and achieved is not None and achieved < RATE_SHORTFALL * planned:
        w.append(LevelWarning("rate_shortfall", f"requests started at {achieved:g}/s where the schedule asked "
                              f"{planned:g}/s (client queue p99 {level.client_queue_p99_ms} ms): "
                              f"{held_back_by or 'the load generator lagged'}",
                              {"achieved_rate": achieved, "scheduled_rate": planned}))
    figures = stats.unstable(level.repeats or {})
    if figures:
        reps = level.repeats or {}
        cvs = {k: reps[k]["cv"] for k in figures}
        text = ", ".join(f"{k} (CV {cv * 100:.0f} %)" for k, cv in cvs.items())
        w.append(LevelWarning("unstable", f"unstable across {reps[figures[0]]['n']} repeats: {text}",
                              {"cv": cvs, "n": reps[figures[0]]["n"]}))
    return w


def _pct(x: Optional[float]) -> str:
    return "nothing" if x is None else f"{x * 100:.1f} %"
