"""One measured level as a typed record, and the warnings that qualify its numbers.

A `Level` carries the reference document's output names (ms, GiB, tok/s; null: unknown or not
exposed). A `LevelWarning` is {code, text, values}: findings and reports read the code and the values,
the text is for people. The thresholds behind the warnings live here, once; findings.py uses the same
ones when it checks documents that carry no warnings of their own."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

from kvexp import stats

MIN_REQUESTS = 20  # fewer requests than this: percentiles are rough
SPREAD_RATIO = 3.0  # TTFT p95 above this x p50: a wide spread
MAX_CV = stats.UNSTABLE_CV  # coefficient of variation across repeats at or above this: unstable
MIN_KV_SAMPLES = 5  # fewer KV-usage samples than this: the peak is a lower bound
RATE_SHORTFALL = 0.9  # an open-loop level that started fewer than this share of its scheduled rate

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
}


@dataclass(frozen=True)
class LevelWarning:
    code: str  # one of WARNING_CODES
    text: str
    values: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"code": self.code, "text": self.text, "values": dict(self.values)}


@dataclass
class Level:
    """One level of one job (a concurrency or a rate, one repeat), as result.json stores it."""

    concurrency: Optional[int]
    rate: Optional[float]
    repeat: int
    status: str  # ok | failed
    requests: int
    errors: int
    errors_by_kind: dict[str, int]
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
    kv_usage_samples: int = 0
    preemptions: Optional[float] = None
    max_running: Optional[int] = None
    max_waiting: Optional[int] = None
    loop_lag_p99_ms: Optional[float] = None
    client_workers: Optional[int] = None
    client_cpu_util: Optional[float] = None
    client_limited: bool = False
    goodput_req_s: Optional[float] = None
    achieved_rate: Optional[float] = None
    scheduled_rate: Optional[float] = None
    status_reason: Optional[str] = None
    repeats: Optional[dict[str, Any]] = None
    warnings: list[LevelWarning] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["warnings"] = [w.to_json() for w in self.warnings]
        for key in ("achieved_rate", "scheduled_rate", "status_reason", "repeats"):
            if out[key] is None:  # only where they apply (open loop, a failed level, the last repeat)
                del out[key]
        return out


def level_warnings(level: Level, prompt_lengths: Sequence[Optional[int]], output_lengths: Sequence[Optional[int]],
                   prompt_tokens: int, max_tokens: int, forced: bool,
                   client_limits: Sequence[str] = ()) -> list[LevelWarning]:
    """What qualifies a level's numbers. prompt/output_lengths: the realised lengths of its successful
    requests (checked against the scenario's only where the backend forces them)."""
    w: list[LevelWarning] = []
    if level.errors:
        w.append(LevelWarning("errors", f"{level.errors} of {level.requests} requests failed",
                              {"errors": level.errors, "requests": level.requests}))
    if level.requests < MIN_REQUESTS:
        w.append(LevelWarning("few_requests", f"only {level.requests} requests: percentiles are rough",
                              {"requests": level.requests, "min_requests": MIN_REQUESTS}))
    if forced:
        bad_prompt = sum(1 for n in prompt_lengths if n is not None and n != prompt_tokens)
        if bad_prompt:
            w.append(LevelWarning("prompt_length", f"{bad_prompt} requests had a prompt length other than "
                                  f"{prompt_tokens} tokens", {"requests": bad_prompt, "asked": prompt_tokens}))
        bad_out = sum(1 for n in output_lengths if n != max_tokens)
        if bad_out:
            w.append(LevelWarning("output_length", f"{bad_out} requests produced other than {max_tokens} "
                                  "output tokens", {"requests": bad_out, "asked": max_tokens}))
    p50, p95 = level.ttft_p50_ms, level.ttft_p95_ms
    if p50 and p95 and p95 > SPREAD_RATIO * p50:
        w.append(LevelWarning("ttft_spread", f"wide TTFT spread: p95 {p95:.1f} ms is over {SPREAD_RATIO:g}x "
                              f"p50 {p50:.1f} ms", {"ttft_p50_ms": p50, "ttft_p95_ms": p95}))
    if level.peak_kv_cache_usage is not None and level.kv_usage_samples < MIN_KV_SAMPLES:
        w.append(LevelWarning("kv_undersampled", f"KV usage was sampled only {level.kv_usage_samples} times "
                              "in this level: its peak is a lower bound", {"samples": level.kv_usage_samples}))
    if client_limits:
        w.append(LevelWarning("client_limited", "; ".join(client_limits) + ": the client may have limited "
                              "this level (set client.workers)",
                              {"loop_lag_p99_ms": level.loop_lag_p99_ms, "client_cpu_util": level.client_cpu_util}))
    planned, achieved = level.scheduled_rate, level.achieved_rate
    if planned and achieved is not None and achieved < RATE_SHORTFALL * planned:
        w.append(LevelWarning("rate_shortfall", f"requests started at {achieved:g}/s where the schedule asked "
                              f"{planned:g}/s: max_concurrency, max_start_rate or a lagging load generator "
                              "held them back", {"achieved_rate": achieved, "scheduled_rate": planned}))
    figures = stats.unstable(level.repeats or {})
    if figures:
        reps = level.repeats or {}
        cvs = {k: reps[k]["cv"] for k in figures}
        text = ", ".join(f"{k} (CV {cv * 100:.0f} %)" for k, cv in cvs.items())
        w.append(LevelWarning("unstable", f"unstable across {reps[figures[0]]['n']} repeats: {text}",
                              {"cv": cvs, "n": reps[figures[0]]["n"]}))
    return w
