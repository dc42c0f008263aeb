"""Every figure kvexp shows, defined once: its key in a level, its label and unit, how it is written,
which direction is better, which level warnings make it not firm, whether a backend may not expose
it, whether it is summarised over repeats, and whose per-request spread stands for its noise.

Statistics (stats.REPEAT_FIGURES), the noise test, findings, the CSV, the job and sweep summaries, the
report's tables and docs/METRICS.md (generated from it) all read this table; nothing else spells a label, a
unit or a number format of a level figure. A missing value is written by one rule (`missing_text`):
"not exposed" for a figure the backend does not report, "not recorded" for one another tool's file
does not hold, "—" otherwise."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Optional


class Fmt(StrEnum):
    """How a value is written: int (whole numbers, else one decimal), pct (a fraction as percent, one
    decimal), fine (two decimals), coarse (one decimal), sig (four significant digits), text."""

    int = "int"
    pct = "pct"
    fine = "fine"
    coarse = "coarse"
    sig = "sig"
    text = "text"


UNKNOWN = "—"
NOT_EXPOSED = "not exposed"  # the backend does not report this figure (null in the result, never 0)
NOT_RECORDED = "not recorded"  # another benchmark tool's file does not hold it


@dataclass(frozen=True)
class Metric:
    key: str  # the level's key; a dotted key reads a nested block ("server.tpot_p50_ms")
    label: str
    unit: str  # "" for counts and words
    fmt: Fmt
    better: Optional[str] = None  # "higher" | "lower" | None (not a performance figure)
    disqualified_by: tuple[str, ...] = ()  # level warning codes (levels.WARNING_CODES) that make it not firm
    exposure: bool = False  # a backend may not expose it: null reads "not exposed"
    repeated: bool = False  # summarised over a level's repeats (mean, 95 % CI, CV)
    spread: Optional[str] = None  # "ttft" | "tpot": the latency whose per-request spread is its noise
    doc: str = ""  # the definition: docs/METRICS.md and the result schema's description carry it
    stored: bool = True  # a key of result.json's levels (False: derived by the report from repeats)

    @property
    def header(self) -> str:
        """The column header: label, then the unit in parentheses ("TTFT p50 (ms)")."""
        return f"{self.label} ({self.unit})" if self.unit else self.label

    def format(self, v: Any) -> str:
        return format_as(self.fmt, v)


_CLIENT = ("client_limited",)
_LAT = ("errors", "few_requests", "client_limited", "unstable")


def _latency(name: str, label: str, fmt: Fmt, spread: Optional[str], doc: str, repeated_at: tuple[str, ...],
             extra: tuple[str, ...] = ()) -> list[Metric]:
    return [Metric(f"{name}_{p}_ms", f"{label} {p}", "ms", fmt, "lower", _LAT + extra, repeated=p in repeated_at,
                   spread=spread, doc=f"{doc}, {p} over the level's successful requests")
            for p in ("p50", "p95", "p99")]


_TABLE: list[Metric] = [
    # what a level is
    Metric("concurrency", "Concurrency", "", Fmt.int, doc="requests in flight (closed loop)"),
    Metric("rate", "Rate", "req/s", Fmt.fine, doc="requests started per second as scheduled (open loop)"),
    Metric("achieved_rate", "Achieved rate", "req/s", Fmt.fine, doc="requests started per second as sent"),
    Metric("repeat", "Repeat", "", Fmt.int, doc="which repeat of the level (0 is the first; tables count from 1)"),
    Metric("status", "Status", "", Fmt.text, doc="ok or failed"),
    Metric("requests", "Requests", "", Fmt.int, doc="requests measured (warm-up excluded)"),
    Metric("errors", "Errors", "", Fmt.int, "lower", doc="requests that failed or returned no token"),
    # speed
    Metric("throughput_tok_s", "Throughput", "tok/s", Fmt.coarse, "higher", _LAT, repeated=True, spread="tpot",
           doc="output tokens of successful requests / the level's wall time"),
    Metric("request_rate", "Request rate", "req/s", Fmt.fine, "higher", _LAT, repeated=True, spread="tpot",
           doc="successful requests / the level's wall time"),
    Metric("goodput_req_s", "Goodput", "req/s", Fmt.fine, "higher", _LAT, repeated=True, spread="tpot",
           doc="requests per second that met the scenario's latency objectives"),
    *_latency("ttft", "TTFT", Fmt.coarse, "ttft", "time to first token: first content chunk - request sent",
              ("p50", "p99"), ("ttft_spread",)),
    *_latency("tpot", "TPOT", Fmt.fine, "tpot", "time per output token: (E2E - TTFT) / (output tokens - 1)",
              ("p50",), ("bursts", "tpot_disagrees")),
    *_latency("itl", "ITL", Fmt.fine, None, "inter-token latency: the gaps between content chunks", ("p50",),
              ("bursts",)),
    *_latency("e2e", "E2E", Fmt.coarse, None, "end-to-end latency: last chunk - request sent", ("p50",)),
    Metric("client_queue_p50_ms", "Client queue p50", "ms", Fmt.coarse, "lower", _CLIENT,
           doc="scheduled start to sent, p50 (time a request waited in the client)"),
    Metric("client_queue_p99_ms", "Client queue p99", "ms", Fmt.coarse, "lower", _CLIENT,
           doc="scheduled start to sent, p99"),
    Metric("wall_s", "Wall", "s", Fmt.coarse, doc="the level's measured time: first request sent to last done"),
    Metric("mean_prompt_tokens", "Mean prompt tokens", "", Fmt.coarse,
           doc="prompt tokens per request as the server counted them"),
    Metric("mean_output_tokens", "Mean output tokens", "", Fmt.coarse,
           doc="output tokens per request as the server counted them"),
    Metric("output_tokens", "Output tokens", "", Fmt.int, doc="output tokens of the level's successful requests"),
    # memory and the KV cache
    Metric("peak_vram_gib", "Peak VRAM", "GiB", Fmt.fine, "lower",
           doc="the GPU's used memory, peak over the level (NVML)"),
    Metric("peak_server_gpu_gib", "Server GPU", "GiB", Fmt.fine, "lower",
           doc="the server's processes' GPU memory, peak over the level (NVML)"),
    Metric("peak_rss_gib", "Peak RSS", "GiB", Fmt.fine, "lower", doc="the server's process tree RSS, peak"),
    Metric("peak_kv_cache_usage", "Peak KV usage", "%", Fmt.pct, exposure=True,
           disqualified_by=("kv_undersampled", "kv_above_plan"),
           doc="the server's own KV-cache usage gauge, peak over the level's samples"),
    Metric("kv_usage_samples", "KV samples", "", Fmt.int, doc="times KV usage was sampled in the level"),
    Metric("preemptions", "Preemptions", "", Fmt.int, "lower", exposure=True,
           doc="requests the server preempted in the level (its counter's increase)"),
    Metric("max_running", "Max running", "", Fmt.int, doc="most requests the server ran at once"),
    Metric("max_waiting", "Max waiting", "", Fmt.int, doc="most requests waiting in the server's queue"),
    Metric("loop_lag_p99_ms", "Client loop lag p99", "ms", Fmt.coarse, "lower",
           doc="how late the load generator's event loop woke from 10 ms sleeps, p99"),
    Metric("client_cpu_util", "Client CPU", "%", Fmt.pct,
           doc="CPU time over wall time of the busiest process that sent the level's requests "
               "(1 = one core fully busy)"),
    # the machine's load over the level: what a comparison across runs must state
    Metric("machine.load_avg_1m", "Load average", "", Fmt.fine,
           doc="the machine's 1-minute load average at the level's end"),
    Metric("machine.busy_share", "Machine CPU busy", "%", Fmt.pct,
           doc="share of all usable CPU time that was busy over the level (server, client and any other process)"),
    Metric("machine.steal_share", "CPU steal", "%", Fmt.pct, "lower",
           doc="share of all CPU time the hypervisor gave to other machines over the level"),
    # the server's own timing of the same requests, and how their tokens arrived
    Metric("server.ttft_mean_ms", "Server TTFT mean", "ms", Fmt.coarse, "lower",
           doc="the server's own time to first token, mean"),
    Metric("server.tpot_p50_ms", "Server TPOT p50", "ms", Fmt.fine, "lower",
           doc="the server's own time per output token, p50"),
    Metric("server.tpot_mean_ms", "Server TPOT mean", "ms", Fmt.fine, "lower",
           doc="the server's own time per output token, mean"),
    Metric("server.queue_mean_ms", "Server queue mean", "ms", Fmt.coarse, "lower",
           doc="time requests waited in the server's queue, mean"),
    Metric("delivery.tokens_per_chunk", "Tokens per chunk", "", Fmt.sig,
           doc="output tokens per streamed content chunk"),
    Metric("delivery.multi_token_chunk_share", "Multi-token chunks", "%", Fmt.pct,
           doc="share of chunks that carried more than one token"),
    Metric("prefix_cache.hit_rate", "Prefix-cache hits", "%", Fmt.pct, exposure=True,
           doc="prompt tokens the server served from its prefix cache / prompt tokens sent"),
    # over repeats, and what qualifies a level
    Metric("repeats", "Repeats", "", Fmt.int,
           doc="over a level's repeats, on the last repeat's entry: per figure its mean, 95 % CI half-width, CV "
               "and n (tables show n)"),
    Metric("throughput_ci95", "Throughput CI95", "tok/s", Fmt.text, stored=False,
           doc="95 % confidence interval of throughput over repeats (Student's t)"),
    Metric("cv", "Throughput CV", "%", Fmt.pct, stored=False,
           doc="coefficient of variation of throughput over repeats"),
    Metric("client_limited", "Client-limited", "", Fmt.text, doc="the load generator may have limited the level"),
    Metric("warnings", "Warnings", "", Fmt.text, doc="what qualifies the level's numbers"),
]
METRICS: dict[str, Metric] = {m.key: m for m in _TABLE}
REPEATED = tuple(m.key for m in _TABLE if m.repeated)


def metric(key: str) -> Metric:
    """The metric of a level key; KeyError names a key no one registered."""
    try:
        return METRICS[key]
    except KeyError:
        raise KeyError(f"{key}: not a registered metric (kvexp/metrics/registry.py)") from None


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def format_as(fmt: Fmt, v: Any) -> str:
    """A value written in a format; None is "—", booleans are yes/no."""
    if v is None:
        return UNKNOWN
    if isinstance(v, bool):
        return "yes" if v else "no"
    if fmt == Fmt.text or not is_num(v):
        return str(v)
    if fmt == Fmt.pct:
        return f"{v * 100:.1f}"
    if fmt == Fmt.int:
        return str(int(v)) if float(v).is_integer() else f"{v:.1f}"
    if fmt == Fmt.fine:
        return f"{v:.2f}"
    if fmt == Fmt.coarse:
        return f"{v:.1f}"
    return f"{v:.4g}"


def missing_text(key: str, *, level_failed: bool, exposed_elsewhere: bool, foreign: bool) -> str:
    """What a table writes for a null figure: "not exposed" when the backend never reported a figure it
    may not expose (no level of the run has it, and the level did not fail), "not recorded" for such a
    figure another tool's file does not hold, "—" otherwise (unknown for this level only)."""
    m = METRICS.get(key)
    if m is None or not m.exposure or level_failed or exposed_elsewhere:
        return UNKNOWN
    return NOT_RECORDED if foreign else NOT_EXPOSED


def shown_value(level: Any, key: str) -> Optional[str]:
    """A level figure (of a metrics.levels.Level) as a person may read it when a warning of the level
    disqualifies it, else None (format it plainly): burst-delivered TPOT p50 shows the server's own TPOT
    marked "(server)", the other burst-delivered latencies "— (bursts)"; an under-sampled KV peak shows as
    a lower bound."""
    m = METRICS.get(key)
    if m is None or not m.disqualified_by or not level.warnings:
        return None  # no warning can disqualify it
    codes = level.warning_codes & set(m.disqualified_by)
    if "bursts" in codes:
        server = level.value("server.tpot_p50_ms")
        server = server if is_num(server) else level.value("server.tpot_mean_ms")
        if key == "tpot_p50_ms" and is_num(server):
            return f"{format_value(key, server)} (server)"
        return f"{UNKNOWN} (bursts)"
    peak = level.value(key)
    if "kv_undersampled" in codes and is_num(peak):
        return f"≥ {format_value(key, peak)}" if peak > 0 else f"{UNKNOWN} (under-sampled)"
    return None


def level_text(level: Any, key: str, *, failed: bool, exposed: bool, foreign: bool = False,
               value: Any = None, plain: bool = False) -> str:
    """One level figure (of a metrics.levels.Level) as every table writes it: disqualified (shown_value),
    missing (missing_text) or formatted. value: the figure when it is not the level's own key (a repeat
    statistic); plain: no disqualification applies to it."""
    shown = None if plain else shown_value(level, key)
    if shown is not None:
        return shown
    v = level.value(key) if value is None and not plain else value
    if v is None:
        return missing_text(key, level_failed=failed, exposed_elsewhere=exposed, foreign=foreign)
    return format_value(key, v)


# Figures that are not a level's (the planner's, a model's, quality's), written by the same formats.
# Keys not listed follow their unit suffix (STYLE: units in names): _ms, _tok_s, _s, _tokens, _pct one
# decimal; _gib two; anything else four significant digits.
FORMATS: dict[str, Fmt] = {
    **{k: Fmt.int for k in ("blocks", "block_size", "capacity_tokens", "prompt_tokens", "max_tokens",
                            "predicted_tokens", "actual_tokens", "calibrated_tokens", "n", "kv_bytes_per_token",
                            "tokens")},
    **{k: Fmt.pct for k in ("predicted_kv_usage", "gpu_memory_utilization", "hit_rate", "multi_token_chunk_share")},
    "tokens_per_chunk": Fmt.sig,
}


def window_words(window_bytes_per_sequence: Optional[float]) -> str:
    """A sliding-window model's fixed part, after its bytes per token: " + 15.00 MiB window/seq" ("" for a
    model without a window)."""
    return "" if not window_bytes_per_sequence else f" + {window_bytes_per_sequence / (1 << 20):,.2f} MiB window/seq"


def format_value(key: str, v: Any) -> str:
    """One value as tables and sentences write it (None: "—"); a dotted key that is not registered
    formats like its last part."""
    if key == "throughput_ci95" and isinstance(v, (list, tuple)):
        return f"{v[0]:.1f}–{v[1]:.1f}" if len(v) == 2 and all(is_num(x) for x in v) else str(v)
    if key == "throughput_ci95" and is_num(v):
        return f"±{v:.1f}"
    if key == "warnings" and isinstance(v, (list, tuple)):
        return "; ".join(str(w.get("text") if isinstance(w, dict) else getattr(w, "text", w)) for w in v)
    if key in METRICS:
        return METRICS[key].format(v)
    name = key.rpartition(".")[2]
    if name in METRICS:
        return METRICS[name].format(v)
    if name in FORMATS:
        return format_as(FORMATS[name], v)
    if name.endswith("_gib"):
        return format_as(Fmt.fine, v)
    if name.endswith(("_ms", "_tok_s", "_s", "_tokens", "_pct")):
        return format_as(Fmt.coarse, v)
    return format_as(Fmt.sig, v)

