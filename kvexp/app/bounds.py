"""Bounds of a composed ExperimentConfig that the per-key checks (app/checks.py) build on: every number
finite and within a range, every count capped, the KV cache type each backend is given one it accepts
and the dtype the job is labelled with, every level given once, and no setting that would be silently
ignored. Each failure is one ConfigError line naming the key, the value and what is allowed."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from kvexp.backends import REGISTRY
from kvexp.backends.ollama import KV_TYPES as OLLAMA_KV_TYPES
from kvexp.capacity.planner import KV_BYTES_PER_ELEMENT
from kvexp.core.config import MAX_RATE, MAX_STREAMS, ClientConfig, ConfigError, ExperimentConfig, ScenarioConfig
from kvexp.core.machine import usable_cpus
from kvexp.results.guards import MAX_RUN_LEVELS

# Upper bounds of settings beyond which a value is a typo, not an experiment (config.py has the
# scenario's own: MAX_STREAMS, MAX_TOKENS, MAX_REQUESTS, MAX_RATE).
MAX_WAIT_S = 86_400.0  # a timeout: a day
MAX_WARMUP = 1000  # warm-up requests: they wake the server and are not measured (a million ran for hours, unsaid)
MAX_SLO_MS = MAX_WAIT_S * 1000  # a latency objective: a day
MAX_POLL_S = 60.0  # a sampling interval
MAX_LEVELS = MAX_STREAMS  # levels of a job, a search's filled grid included
DEFAULTS = ScenarioConfig  # the defaults of the settings that only some scenarios read
DEFAULT_MIN_GROWTH = ScenarioConfig.search_min_growth
MAX_LAYERS = 65_536  # a model's layers, KV heads, head size; the layers offloaded to the GPU
MAX_PARAMS_B = 100_000.0  # billions of parameters (100 trillion)
MAX_GIB = float(1 << 20)  # weights or GPU memory: a PiB
MAX_WEIGHT_BITS = 64.0
MAX_THREADS = 4096
MAX_BLOCK = 65_536  # tokens per KV block (vLLM --block-size)
MAX_KV_BYTES = 1 << 50  # a KV budget (vLLM --kv-cache-memory-bytes): a PiB
MAX_GROWTH = 100.0  # a search's plateau threshold: 10,000 % growth per level
MAX_DEPTHS = 64  # quality.depths
MAX_CHUNKS = 10_000  # quality.chunks: windows per depth
MAX_PROMPTS = 100_000  # quality.prompts: greedy continuations
MAX_TOP_K = 1000  # quality.top_k: log-probabilities per position
MIN_LOG_MB = 0.01  # a server log's cap (10 KiB): room for a head, the marker line and some of the latest output
MAX_LOG_MB = float(1 << 20)  # a TiB
MIN_WORKER_CAP = 2  # client.workers may be 2 even on one core (the multi-process path stays testable)

# The KV cache types each server accepts, in its own spelling: llama-server -ctk/-ctv, vllm serve
# --kv-cache-dtype, Ollama's OLLAMA_KV_CACHE_TYPE. An adapter class may declare its own as `kv_types`.
ACCEPTED_KV: dict[str, tuple[str, ...]] = {
    "llamacpp": ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl"),
    "vllm": ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc"),
    "ollama": tuple(OLLAMA_KV_TYPES),
}
# Spellings of one dtype, to the portable name (conf/kv/*.yaml); block types are their own name.
_SAME_DTYPE = {"f16": "fp16", "float16": "fp16", "half": "fp16", "bfloat16": "bf16", "fp32": "f32",
               "float32": "f32", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "fp8_inc": "fp8"}


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def num(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"


def in_range(key: str, value: Any, lo: float, hi: float, *, low_open: bool = False, null: Optional[str] = None,
             unit: str = "", why: str = "") -> None:
    """value finite and within [lo, hi] ((lo, hi] with low_open); None allowed when `null` says what it
    means. With `why` (what the upper bound stands for) the bound ends the message, after the null note."""
    if value is None and null is not None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > lo if low_open else value >= lo) and value <= hi
    lo_s = f"> {num(lo)}" if low_open else f">= {num(lo)}"
    hi_s = f" and <= {num(hi)}{unit}"
    note = f" (or null: {null})" if null else ""
    require(ok, f"{key}={value}: must be {lo_s}" + (f"{note}{hi_s} ({why})" if why else f"{hi_s}{note}"))


# ---------------------------------------------------------------- numbers
def check_finite(obj: Any, key: str = "") -> None:
    """Every float of the config tree finite (a dataclass's fields, lists and dicts, by dotted key): inf
    or nan passes `x > 0`, and would reach the server, a sleep or the result file."""
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            check_finite(getattr(obj, f.name), f"{key}{'.' if key else ''}{f.name}")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            check_finite(v, f"{key}.{k}")
    elif isinstance(obj, (list, tuple)):
        bad = [v for v in obj if isinstance(v, float) and not math.isfinite(v)]
        require(not bad, f"{key}={list(obj)}: {bad[0] if bad else ''} is not a finite number; allowed values are "
                "finite numbers")
    elif isinstance(obj, float):
        require(math.isfinite(obj), f"{key}={obj}: not a finite number; allowed values are finite numbers")


def max_workers() -> int:
    return max(MIN_WORKER_CAP, usable_cpus())


def check_workers(c: ClientConfig) -> None:
    """client.workers: auto, or a number of worker processes up to the cores kvexp may use."""
    w, cores = c.workers, usable_cpus()
    cap = max_workers()
    ok = w == "auto" or (isinstance(w, int) and not isinstance(w, bool) and 1 <= w <= cap)
    floor = f", at least {MIN_WORKER_CAP}" if cap > cores else ""
    require(ok, f"client.workers={w!r}: allowed values are auto or 1..{cap} (one worker process per CPU core "
            f"kvexp may use: {cores} here{floor}; more only take turns on the cores and delay the requests they time)")


# ---------------------------------------------------------------- levels and settings used only together
def check_levels(s: ScenarioConfig) -> None:
    """Each level given once, a bounded number of levels, and no setting that only another kind of
    scenario reads (kvexp never ignores a setting)."""
    for key, levels in (("scenario.concurrency", list(s.concurrency)), ("scenario.rates", list(s.rates))):
        seen = sorted({x for x in levels if levels.count(x) > 1})
        require(not seen, f"{key}={levels}: level {seen[0] if seen else ''} is given twice; each level is measured "
                "once per repeat (scenario.repeats repeats them); allowed: distinct levels")
        require(len(levels) <= MAX_LEVELS, f"{key}: {len(levels):,} levels; allowed at most {MAX_LEVELS:,} per job")
    over = [c for c in s.concurrency  # (a level out of range is refused as such)
            if isinstance(c, int) and isinstance(s.requests, int) and s.requests < c <= MAX_STREAMS]
    require(not over or bool(s.trace), f"scenario.concurrency={list(s.concurrency)}: level {over[0] if over else ''} "
            f"never has that many requests in flight, as a level sends {s.requests} (scenario.requests); allowed: "
            "levels up to scenario.requests (or more requests)")
    rates = [x for x in s.rates if isinstance(x, (int, float)) and x > 0]
    if rates and isinstance(s.requests, int) and not s.trace:  # a level's requests go out over requests / rate
        span = s.requests / min(rates)
        require(span <= MAX_WAIT_S, f"scenario.rates={list(s.rates)}: level {min(rates)} sends its "
                f"{s.requests:,} requests (scenario.requests) over {span / 3600:,.1f} hours; allowed: levels that send "
                f"them within a day (requests / rate <= {MAX_WAIT_S:,.0f} s)")
    require(s.max_concurrency is None or not s.concurrency,
            f"scenario.max_concurrency={s.max_concurrency}: caps open-loop levels (scenario.rates) only, and "
            f"scenario.concurrency={list(s.concurrency)} is closed loop (each level is its own cap); allowed: null, "
            "or rates with scenario.concurrency=[]")
    require(s.time_scale == 1.0 or bool(s.trace),
            f"scenario.time_scale={s.time_scale}: only a trace replay (scenario.trace) is scaled in time; allowed: "
            "1 without a trace")
    require(s.search_resolution is None or s.search is not None,
            f"scenario.search_resolution={s.search_resolution}: only an SLO search (scenario.search) fills its grid; "
            "allowed: null without a search")


def check_together(s: ScenarioConfig) -> None:
    """Once each setting is within its range: a job of at most MAX_RUN_LEVELS level runs, and no setting
    that only another kind of scenario reads."""
    measured = (len(s.rates) or len(s.concurrency)) * s.repeats
    require(s.search is not None or measured <= MAX_RUN_LEVELS,
            f"scenario.repeats={s.repeats} x {len(s.rates) or len(s.concurrency):,} levels: {measured:,} level runs; "
            f"allowed at most {MAX_RUN_LEVELS:,} per job (its report lays out every one)")
    open_loop = bool(s.rates) or bool(s.trace)
    require(s.arrival == "constant" or open_loop,
            f"scenario.arrival={s.arrival}: only open-loop levels (scenario.rates) have "
            "arrivals; a closed-loop level sends each request when the one before it ends; allowed: constant "
            "without rates")
    require(not s.conversation.think_time_s or s.conversation.turns > 1,
            f"scenario.conversation.think_time_s={s.conversation.think_time_s}: the time between the turns of a "
            "conversation, and scenario.conversation.turns=1 has none; allowed: 0 with one turn")
    no_slo = s.slo_ttft_ms is None and s.slo_tpot_ms is None
    require(s.slo_percentile == "p95" or not no_slo,
            f"scenario.slo_percentile={s.slo_percentile}: the percentile the latency objectives (scenario.slo_ttft_ms, "
            "scenario.slo_tpot_ms) are held to, and none is set; allowed: p95 (the default) without objectives")
    require(s.prefix_groups == DEFAULTS.prefix_groups or s.prefix_tokens > 0,
            f"scenario.prefix_groups={s.prefix_groups}: the number of shared prefixes of scenario.prefix_tokens "
            "tokens, and scenario.prefix_tokens=0 shares none; allowed: 1 (the default) without a prefix")
    require(s.trace_block_tokens == DEFAULTS.trace_block_tokens or bool(s.trace),
            f"scenario.trace_block_tokens={s.trace_block_tokens}: the tokens each hash id of a trace stands for, "
            f"and no trace is replayed (scenario.trace); allowed: {DEFAULTS.trace_block_tokens} (the default) "
            "without a trace")
    growth = s.search_min_growth
    require(growth == DEFAULT_MIN_GROWTH or s.search is not None or not math.isfinite(growth or 0),  # (inf: below)
            f"scenario.search_min_growth={s.search_min_growth}: only an SLO search (scenario.search) stops on a "
            f"plateau; allowed: {DEFAULT_MIN_GROWTH} (the default) without a search")


def check_grid(s: ScenarioConfig) -> None:
    """An SLO search's resolution and plateau threshold within range, and its filled grid at most
    MAX_LEVELS levels (a tiny resolution would otherwise build the grid for hours)."""
    levels = list(s.concurrency if s.search == "concurrency" else s.rates)
    closed = s.search == "concurrency"
    in_range("scenario.search_resolution", s.search_resolution, 0, MAX_STREAMS if closed else MAX_RATE,
             low_open=True, unit="" if closed else " requests/s", null="the grid as given")
    in_range("scenario.search_min_growth", s.search_min_growth, 0, MAX_GROWTH, null="never stop on a plateau")
    if s.search_resolution and levels and all(isinstance(x, (int, float)) and math.isfinite(x) for x in levels):
        filled = math.floor((max(levels) - min(levels)) / s.search_resolution + 1e-9) + 1 + len(levels)
        require(filled <= MAX_LEVELS, f"scenario.search_resolution={s.search_resolution}: fills "
                f"scenario.{'concurrency' if closed else 'rates'}={levels} with {filled:,} levels; allowed at most "
                f"{MAX_LEVELS:,} per job (raise the resolution)")


# ---------------------------------------------------------------- the KV cache type per backend
def accepted_kv_types(backend: str) -> Optional[tuple[str, ...]]:
    """The KV cache types a backend's server accepts, in its own spelling (None: not known)."""
    declared = getattr(REGISTRY.get(backend), "kv_types", None)
    return tuple(declared) if declared else ACCEPTED_KV.get(backend)


def kv_dtype(spelling: str) -> Optional[str]:
    """The portable dtype a spelling stores (fp16 for f16, float16, ...); None for one whose dtype is not
    fixed by the name (vLLM's auto: the model's own dtype) or not known."""
    if "/" in str(spelling):  # a K/V pair: each part a dtype
        k, _, v = str(spelling).partition("/")
        kd, vd = kv_dtype(k), kv_dtype(v)
        return f"{kd}/{vd}" if kd and vd and "/" not in v else None
    key = str(spelling).strip().lower()
    key = _SAME_DTYPE.get(key, key)
    return key if key in KV_BYTES_PER_ELEMENT else None


def check_kv_types(cfg: ExperimentConfig) -> None:
    """kv.name is a dtype kvexp knows, and each kv.per_backend entry names a backend, is a type that
    backend accepts and stores that dtype: the job is labelled and reported with kv.name, so
    kv=fp16 with per_backend.llamacpp=q4_1 would report a q4_1 cache as fp16."""
    kv = cfg.kv
    want = kv_dtype(kv.name)
    known = sorted({kv_dtype(k) for k in KV_BYTES_PER_ELEMENT} - {None})
    require(want is not None, f"kv.name={kv.name!r}: not a KV cache dtype kvexp knows; allowed values are "
            f"{', '.join(known)}")
    for backend, spelling in sorted(kv.per_backend.items()):
        key = f"kv.per_backend.{backend}"
        require(backend in REGISTRY, f"{key}: no such backend; allowed keys are {', '.join(sorted(REGISTRY))}")
        accepted = accepted_kv_types(backend)
        job = f"kv={kv.name}, backend={cfg.backend.name}"
        if "/" in spelling:
            require(getattr(REGISTRY.get(backend), "kv_pairs", False), f"{key}={spelling!r}: a K/V pair, but "
                    f"backend={backend} sets one KV cache type for K and V together; use one type")
            require(accepted is None or all(t in accepted for t in spelling.split("/")), f"{key}={spelling!r}: "
                    f"not a pair of KV cache types backend={backend} accepts; allowed values are "
                    f"{', '.join(accepted or ())}")
        require(accepted is None or spelling in accepted or "/" in spelling, f"{key}={spelling!r}: not a KV cache type backend={backend} "
                f"accepts (the job: {job}); allowed values are {', '.join(accepted or ())}")
        got = kv_dtype(spelling)
        same = [t for t in (accepted or ()) if kv_dtype(t) == want]
        what = f"a {got} KV cache" if got else "the model's own dtype, not a fixed one"
        allowed = (f"allowed for kv={kv.name} on {backend}: {', '.join(same)}" if same else
                   f"{backend} has no {want} KV cache: leave kv.per_backend.{backend} out")
        require(got == want,
                f"{key}={spelling!r}: {what}, but the job ({job}) is labelled and reported as {want}; {allowed}")
