"""Pure statistics over raw request records. Each metric is defined once, here.

Definitions (times on the load generator's perf_counter clock; a request counts only if it succeeded):
- TTFT  = first output token arrival - request sent
- E2E   = last byte of the response - request sent
- TPOT  = (E2E - TTFT) / (output tokens - 1), per request with at least 2 output tokens
- ITL   = gap between consecutive output-token arrivals within a request, pooled over requests
- throughput_tok_s = output tokens of the level's successful requests / level wall time
- level wall time  = last request done - first request sent
- request_rate     = successful requests / level wall time
- achieved_rate    = requests started per second (open loop: beside the asked rate; see start_rate)
- goodput          = requests meeting every given objective (TTFT, TPOT) / level wall time
Token counts are the server's own (`usage`); percentiles interpolate linearly (numpy's default).
Unknown is None, never 0.

Repeats: each figure's mean over a level's repeats, the half-width of its 95 % confidence interval
(Student's t) and its coefficient of variation (sample standard deviation / mean); a figure whose CV
is at least UNSTABLE_CV is flagged as unstable.

The client's self-check (client_limits): a level is flagged as possibly limited by the client when
the load generator's event loop woke late from its 10 ms sleeps (p99 lag above CLIENT_LAG_LIMIT_MS,
or above CLIENT_LAG_ITL_FRACTION of the level's ITL p50 when that is larger) or when a process that
sent requests was busy for at least CLIENT_CPU_LIMIT of one core. A token that arrives while the loop
is busy is stamped when the loop gets to it, so the lag is the client's own timing error.

Delivery (delivery): a chunk is one read of the response body; tokens in one chunk share a timestamp,
so ITL is per delivered chunk, not per token, when several tokens share one. tokens_per_chunk = output
tokens / chunks; multi_token_chunk_share = chunks that carried more than one token / chunks (where the
server merged tokens into one stream event, the extra tokens are counted as making single-event chunks
multi-token: a lower bound). A level is flagged as streamed in bursts when tokens_per_chunk >=
BURST_TOKENS_PER_CHUNK or multi_token_chunk_share >= BURST_CHUNK_SHARE: its client TPOT and ITL then
reflect delivery, not decoding, and the server's own TPOT is the figure for decoding speed.

The server's view (server_view_*): what the server itself measured for the same requests, per
request (llama-server's `timings`, Ollama's durations) or from its histograms' differences over the
level (vLLM's /metrics: mean = delta sum / delta count)."""

from __future__ import annotations

import math
from statistics import fmean, stdev
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from kvexp.metrics import registry
from kvexp.metrics.records import RequestRecord

MS = 1000.0
GIB = float(1 << 30)


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def mean(values: Sequence[float]) -> Optional[float]:
    return fmean(values) if len(values) else None


def value_summary(values: Sequence[float]) -> Optional[dict]:
    """{"n", "mean", "p50", "p99", "min", "max"} of `values` (mean to 3 decimals); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return {"n": len(ordered), "mean": round(fmean(ordered), 3), "p50": percentile(ordered, 50),
            "p99": percentile(ordered, 99), "min": ordered[0], "max": ordered[-1]}


def histogram(values: Sequence[float], bins: int = 10) -> list[dict]:
    """Counts of `values` in equal-width integer bins [{"lo", "hi", "count"}] (lo..hi inclusive)
    covering floor(min)..ceil(max); at most `bins` bins and never more than the integers in that
    range, so all-equal values give one bin; the last bin stops at the maximum. [] for no values."""
    if bins < 1:
        raise ValueError(f"bins={bins}: must be >= 1")
    if not values:
        return []
    lo, hi = math.floor(min(values)), math.ceil(max(values))
    span = hi - lo + 1
    width = math.ceil(span / min(bins, span))
    count = math.ceil(span / width)
    counts = [0] * count
    for v in values:
        counts[min(count - 1, (math.floor(v) - lo) // width)] += 1
    return [{"lo": lo + i * width, "hi": min(hi, lo + (i + 1) * width - 1), "count": c} for i, c in enumerate(counts)]


def ttft_s(r: RequestRecord) -> Optional[float]:
    return None if r.first_token_s is None or r.sent_s is None else r.first_token_s - r.sent_s


def e2e_s(r: RequestRecord) -> Optional[float]:
    return None if r.done_s is None or r.sent_s is None else r.done_s - r.sent_s


def tpot_s(r: RequestRecord) -> Optional[float]:
    t, e = ttft_s(r), e2e_s(r)
    if t is None or e is None or not r.output_tokens or r.output_tokens < 2:
        return None
    return (e - t) / (r.output_tokens - 1)


def itls_s(r: RequestRecord) -> list[float]:
    ts = r.token_times_s
    return [b - a for a, b in zip(ts, ts[1:])]


def _ms(v: Optional[float], nd: int = 2) -> Optional[float]:
    return None if v is None else round(v * MS, nd)


def _r(v: Optional[float], nd: int) -> Optional[float]:
    return None if v is None else round(v, nd)


def summarize_level(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """The level's metrics in the output format (reference names, ms, tok/s)."""
    ok = [r for r in records if r.ok]
    starts = [r.sent_s for r in records if r.sent_s is not None]
    ends = [r.done_s for r in records if r.done_s is not None]
    wall = (max(ends) - min(starts)) if starts and ends else None
    out_tokens = [r.output_tokens for r in ok if r.output_tokens is not None]
    prompt_tokens = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    ttfts = [v for r in ok if (v := ttft_s(r)) is not None]
    tpots = [v for r in ok if (v := tpot_s(r)) is not None]
    e2es = [v for r in ok if (v := e2e_s(r)) is not None]
    itls = [g for r in ok for g in itls_s(r)]
    queue = [r.sent_s - r.scheduled_s for r in records if r.scheduled_s is not None and r.sent_s is not None]
    tokens_known = len(out_tokens) == len(ok) and ok
    throughput = (sum(out_tokens) / wall) if (tokens_known and wall and wall > 0) else None
    errors_by_kind: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors_by_kind[r.error_kind] = errors_by_kind.get(r.error_kind, 0) + 1
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "errors_by_kind": errors_by_kind,
        "throughput_tok_s": _r(throughput, 1),
        "request_rate": _r(len(ok) / wall, 3) if wall and wall > 0 else None,
        "ttft_p50_ms": _ms(percentile(ttfts, 50)),
        "ttft_p95_ms": _ms(percentile(ttfts, 95)),
        "ttft_p99_ms": _ms(percentile(ttfts, 99)),
        "tpot_p50_ms": _ms(percentile(tpots, 50), 3),
        "tpot_p95_ms": _ms(percentile(tpots, 95), 3),
        "tpot_p99_ms": _ms(percentile(tpots, 99), 3),
        "itl_p50_ms": _ms(percentile(itls, 50), 3),
        "itl_p95_ms": _ms(percentile(itls, 95), 3),
        "itl_p99_ms": _ms(percentile(itls, 99), 3),
        "e2e_p50_ms": _ms(percentile(e2es, 50)),
        "e2e_p95_ms": _ms(percentile(e2es, 95)),
        "e2e_p99_ms": _ms(percentile(e2es, 99)),
        "client_queue_p50_ms": _ms(percentile(queue, 50)),
        "client_queue_p99_ms": _ms(percentile(queue, 99)),
        "wall_s": _r(wall, 4),
        "mean_prompt_tokens": _r(mean(prompt_tokens), 1),
        "mean_output_tokens": _r(mean(out_tokens), 1),
        "output_tokens": sum(out_tokens) if tokens_known else None,
    }


def start_rate(records: Sequence[RequestRecord], scheduled: bool = False) -> Optional[float]:
    """Requests started per second over the level: (n - 1) / (last start - first start), from the
    times they were sent (achieved) or, with scheduled, from the open-loop schedule (asked)."""
    ts = sorted(t for r in records if (t := (r.scheduled_s if scheduled else r.sent_s)) is not None)
    if len(ts) < 2 or ts[-1] <= ts[0]:
        return None
    return round((len(ts) - 1) / (ts[-1] - ts[0]), 3)


def meets_slo(r: RequestRecord, slo_ttft_ms: Optional[float], slo_tpot_ms: Optional[float]) -> bool:
    if not r.ok:
        return False
    t, p = ttft_s(r), tpot_s(r)
    if slo_ttft_ms is not None and (t is None or t * MS > slo_ttft_ms):
        return False
    if slo_tpot_ms is not None and (p is not None and p * MS > slo_tpot_ms):
        return False
    return True


def goodput(records: Sequence[RequestRecord], slo_ttft_ms: Optional[float], slo_tpot_ms: Optional[float],
            wall_s: Optional[float]) -> Optional[float]:
    """Requests per second that met every objective given (None when no objective or no wall time)."""
    if (slo_ttft_ms is None and slo_tpot_ms is None) or not wall_s:
        return None
    return round(sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in records) / wall_s, 3)


CLIENT_LAG_LIMIT_MS = 5.0
CLIENT_LAG_ITL_FRACTION = 0.5
CLIENT_CPU_LIMIT = 0.9
BURST_TOKENS_PER_CHUNK = 1.5
BURST_CHUNK_SHARE = 0.25


def delivery(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """How the successful requests' tokens arrived: chunks (reads), tokens per chunk, the share of
    multi-token chunks, and whether the level was streamed in bursts (see the module's docstring)."""
    chunks = multi = tokens = 0
    for r in records:
        if not r.ok or not r.token_times_s or r.output_tokens is None:
            continue
        per_read: dict[float, int] = {}
        for t in r.token_times_s:
            per_read[t] = per_read.get(t, 0) + 1
        merged = max(0, r.output_tokens - len(r.token_times_s))  # tokens the server put in shared events
        singles = sum(1 for n in per_read.values() if n == 1)
        chunks += len(per_read)
        multi += len(per_read) - singles + min(merged, singles)
        tokens += r.output_tokens
    if not chunks:
        return {"chunks": None, "tokens_per_chunk": None, "multi_token_chunk_share": None, "bursts": None}
    per_chunk, share = tokens / chunks, multi / chunks
    return {"chunks": chunks, "tokens_per_chunk": round(per_chunk, 3), "multi_token_chunk_share": round(share, 4),
            "bursts": per_chunk >= BURST_TOKENS_PER_CHUNK or share >= BURST_CHUNK_SHARE}


def client_limits(loop_lag_p99_ms: Optional[float], itl_p50_ms: Optional[float],
                  cpu_util: Sequence[float]) -> list[str]:
    """Why the client may have limited a level (empty when it kept up); see the module's docstring.
    Pass itl_p50_ms None for a level streamed in bursts: its ITL is the server's delivery, no yardstick
    for the client."""
    out = []
    limit = max(CLIENT_LAG_LIMIT_MS, CLIENT_LAG_ITL_FRACTION * itl_p50_ms if itl_p50_ms else 0.0)
    if loop_lag_p99_ms is not None and loop_lag_p99_ms > limit:
        out.append(f"client event loop lagged {loop_lag_p99_ms:g} ms (p99, limit {limit:g} ms)")
    busy = max(cpu_util, default=0.0)
    if busy >= CLIENT_CPU_LIMIT:
        out.append(f"a client process was busy {busy * 100:.0f} % of a core")
    return out


# Student's t, two-sided 95 %, by degrees of freedom (scipy-free; df > 30 uses 1.96)
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042]


def repeat_summary(values: Iterable[Optional[float]]) -> Optional[dict[str, Optional[float]]]:
    """Mean, 95 % confidence half-width and coefficient of variation over repeats."""
    xs = [v for v in values if v is not None]
    if not xs:
        return None
    m = fmean(xs)
    if len(xs) < 2:
        return {"mean": m, "ci95": None, "cv": None, "n": len(xs)}
    sd = stdev(xs)
    t = _T95[len(xs) - 2] if len(xs) - 1 <= len(_T95) else 1.96
    return {"mean": m, "ci95": t * sd / math.sqrt(len(xs)), "cv": (sd / m) if m else None, "n": len(xs)}


UNSTABLE_CV = 0.10
REPEAT_FIGURES = registry.REPEATED


def repeats_of(levels: Sequence[Any]) -> dict[str, dict[str, Optional[float]]]:
    """The repeat summary of one level's repeats (their levels.Level entries, which import this module):
    {figure: {mean, ci95, cv, n}}
    for every figure of REPEAT_FIGURES that some repeat has; means and intervals rounded."""
    out = {}
    for key in REPEAT_FIGURES:
        r = repeat_summary(lv.value(key) for lv in levels)
        if r is not None:
            out[key] = {k: (None if v is None else round(v, 4) if k == "cv" else v if k == "n" else round(v, 3))
                        for k, v in r.items()}
    return out


def unstable(repeats: dict[str, dict[str, Optional[float]]]) -> list[str]:
    """Figures whose coefficient of variation across repeats is at least UNSTABLE_CV."""
    return [k for k, r in repeats.items() if r.get("cv") is not None and r["cv"] >= UNSTABLE_CV]


def _ms_or_none(values: Sequence[float], q: Optional[float] = None) -> Optional[float]:
    if not values:
        return None
    return _ms(percentile(values, q) if q is not None else fmean(values), 3)


def server_view_from_requests(timings: Sequence[dict[str, Optional[float]]], source: str) -> Optional[dict[str, Any]]:
    """The server's own per-request figures over a level: TPOT and prefill (p50 and mean, ms) and the
    prompt tokens it served from its cache. Each timing: {tpot_s, prefill_s, cached_tokens} (None where
    the server did not say)."""
    if not timings:
        return None
    tpot = [t["tpot_s"] for t in timings if t.get("tpot_s") is not None]
    prefill = [t["prefill_s"] for t in timings if t.get("prefill_s") is not None]
    cached = [t["cached_tokens"] for t in timings if t.get("cached_tokens") is not None]
    return {"source": source, "requests": len(timings),
            "tpot_p50_ms": _ms_or_none(tpot, 50), "tpot_mean_ms": _ms_or_none(tpot),
            "prefill_p50_ms": _ms_or_none(prefill, 50), "prefill_mean_ms": _ms_or_none(prefill),
            "cached_prompt_tokens": int(sum(cached)) if cached else None}


def histogram_means(before: dict[str, float], after: dict[str, float], names: dict[str, str]) -> dict[str, Optional[float]]:
    """{figure: mean in ms} over a level from cumulative histograms read before and after it:
    (after sum - before sum) / (after count - before count), for names = {figure: histogram name}."""
    out: dict[str, Optional[float]] = {}
    for figure, name in names.items():
        try:
            n = after[name + "_count"] - before.get(name + "_count", 0.0)
            total = after[name + "_sum"] - before.get(name + "_sum", 0.0)
        except KeyError:
            out[figure] = None
            continue
        out[figure] = _ms(total / n, 3) if n > 0 else None
    return out


def counter_delta(before: dict[str, float], after: dict[str, float], name: str) -> Optional[float]:
    if name not in after:
        return None
    return after[name] - before.get(name, 0.0)


def _num(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(float(x), 3)


def workload_view(records: Sequence[RequestRecord], timed: bool) -> dict[str, Any]:
    """A level's workload as asked and as the server counted it: prompt and output lengths (asked
    where the request asked an exact one; realised over the successful requests), how many prompts came
    out exactly as asked, and for a timed schedule (a trace) how far the sends were from their times
    (sent_s - scheduled_s, ms)."""
    done = [r for r in records if r.ok]
    asked_prompt = [r.target_prompt_tokens for r in records if r.target_prompt_tokens is not None]
    pairs = [(r.prompt_tokens, r.target_prompt_tokens) for r in done
             if r.prompt_tokens is not None and r.target_prompt_tokens is not None]
    out: dict[str, Any] = {
        "prompt_tokens": {"asked": value_summary(asked_prompt),
                          "realised": value_summary([r.prompt_tokens for r in done if r.prompt_tokens is not None])},
        "output_tokens": {"asked": value_summary([r.max_tokens for r in records if r.max_tokens is not None]),
                          "realised": value_summary([r.output_tokens for r in done if r.output_tokens is not None])},
        "prompts_exact": None if not pairs else sum(1 for got, asked in pairs if got == asked),
        "prompts_checked": len(pairs),
        "prompt_histogram": histogram([r.prompt_tokens for r in done if r.prompt_tokens is not None], 8),
    }
    if timed:
        lag = [(r.sent_s - r.scheduled_s) * 1000 for r in records if r.sent_s is not None and r.scheduled_s is not None]
        out["arrival_error_ms"] = None if not lag else {
            "p50": _num(percentile(lag, 50)), "p99": _num(percentile(lag, 99)), "max": _num(max(lag))}
    return out


def turn_table(records: Sequence[RequestRecord], cached: Sequence[Optional[float]]) -> list[dict[str, Any]]:
    """Per turn of a level's conversations: requests, mean prompt tokens (they grow with the history),
    mean prompt tokens the server served from its cache (None: not stated), TTFT p50 (ms)."""
    rows: dict[int, list[tuple[RequestRecord, Optional[float]]]] = {}
    for r, c in zip(records, cached):
        if r.turn is not None:
            rows.setdefault(r.turn, []).append((r, c))
    out = []
    for turn in sorted(rows):
        ok = [(r, c) for r, c in rows[turn] if r.ok]
        prompt = [r.prompt_tokens for r, _ in ok if r.prompt_tokens is not None]
        hits = [c for _, c in ok if c is not None]
        ttft = [r.first_token_s - r.sent_s for r, _ in ok if r.first_token_s is not None and r.sent_s is not None]
        out.append({"turn": turn, "requests": len(rows[turn]), "errors": len(rows[turn]) - len(ok),
                    "mean_prompt_tokens": round(fmean(prompt), 3) if prompt else None,
                    "mean_cached_tokens": round(fmean(hits), 3) if hits else None,
                    "ttft_p50_ms": _ms_or_none(ttft, 50)})
    return out


def prefix_cache_view(source: str, queried: float, hits: float) -> dict[str, Any]:
    """A level's prefix cache: prompt tokens looked up and served from the cache, and their ratio."""
    return {"source": source, "queried_tokens": int(queried), "hit_tokens": int(hits),
            "hit_rate": round(hits / queried, 4) if queried > 0 else None}
