"""Checks of a composed ExperimentConfig that Hydra's typing cannot make: ranges, addresses, the
backend's own rules and environment, the scenario against the context. Each failure is one ConfigError
line naming the key. Hydra's config store is filled here too (register_configs)."""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from hydra.core.config_store import ConfigStore

from kvexp.app import bounds
from kvexp.app.bounds import (MAX_BLOCK, MAX_CHUNKS, MAX_DEPTHS, MAX_GIB, MAX_KV_BYTES, MAX_LAYERS, MAX_PARAMS_B,
                              MAX_POLL_S, MAX_PROMPTS, MAX_SLO_MS, MAX_THREADS, MAX_TOP_K, MAX_WAIT_S, MAX_WARMUP,
                              MAX_WEIGHT_BITS,
                              in_range as _in, num as _num, require as _require)
from kvexp.backends import REGISTRY, adapter_class
from kvexp.core import placement
from kvexp.core.config import (MAX_RATE, MAX_REQUESTS, MAX_STREAMS, MAX_TOKENS, ClientConfig, ConfigError,
                               ExperimentConfig, GPUConfig, KVConfig, ModelConfig, QualityConfig, ScenarioConfig,
                               Unsupported, check_kv, job_label)
from kvexp.core.paths import data_dir, file_problem
from kvexp.results.guards import MAX_NAME_CHARS, MAX_REPEATS, hidden_char
from kvexp.workload import scenario


# The portable names of llama.cpp's cache types (conf/kv/*.yaml) and its own spelling; every ordered pair of
# two different ones is a K/V choice, kv=<K>/<V>, for the backends that take K and V types apart (kv_pairs).
LLAMA_TYPES = {"fp16": "f16", "bf16": "bf16", "q8_0": "q8_0", "q5_1": "q5_1", "q5_0": "q5_0", "q4_1": "q4_1",
               "q4_0": "q4_0", "iq4_nl": "iq4_nl"}
KV_PAIRS = tuple((k, v) for k in LLAMA_TYPES for v in LLAMA_TYPES if k != v)


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="experiment_schema", node=ExperimentConfig)
    for adapter in REGISTRY.values():
        cs.store(group="backend", name=f"{adapter.name}_schema", node=adapter.config_class)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="kv", name="kv_schema", node=KVConfig)
    for k, v in KV_PAIRS:  # kv=q8_0/q4_0: the K cache at q8_0, the V cache at q4_0 (conf/kv/<K>.yaml's types)
        cs.store(group=f"kv/{k}", name=v, node=KVConfig(name=f"{k}/{v}", per_backend={
            name: f"{LLAMA_TYPES[k]}/{LLAMA_TYPES[v]}" for name, a in REGISTRY.items() if getattr(a, "kv_pairs", False)}))
    cs.store(group="scenario", name="scenario_schema", node=ScenarioConfig)
    cs.store(group="gpu", name="gpu_schema", node=GPUConfig)


def check_config(cfg: ExperimentConfig, kv_choices: dict[str, KVConfig] | None = None,
                 serves: bool = True) -> None:
    """Semantic checks Hydra's typing cannot make. Raises ConfigError with one line. Every float of the
    config must be finite (bounds.check_finite): after the per-key checks, whose messages say the range,
    or when one of them stumbles over an inf or nan before saying so. serves=False (a plan): the model
    need not name a file for the backend to serve."""
    try:
        _check_config(cfg, kv_choices, serves)
    except ConfigError:
        raise
    except (ArithmeticError, ValueError, TypeError):  # e.g. int(inf) in a derived figure: name the setting
        bounds.check_finite(cfg)
        raise
    bounds.check_finite(cfg)


def _check_config(cfg: ExperimentConfig, kv_choices: dict[str, KVConfig] | None, serves: bool) -> None:
    b, s, kv = cfg.backend, cfg.scenario, cfg.kv
    ref = adapter_class(b.name).served_field(cfg.model)
    _require(cfg.unsupported in tuple(Unsupported),
             f"unsupported={cfg.unsupported!r}: allowed values are {', '.join(Unsupported)}")
    _require(s.prompt_tokens >= 1, f"scenario.prompt_tokens={s.prompt_tokens}: must be >= 1")
    _require(s.max_tokens >= 1, f"scenario.max_tokens={s.max_tokens}: must be >= 1")
    _require(s.requests >= 1, f"scenario.requests={s.requests}: must be >= 1")
    _require(s.warmup_requests >= 0, f"scenario.warmup_requests={s.warmup_requests}: must be >= 0")
    _require(s.repeats >= 1, f"scenario.repeats={s.repeats}: must be >= 1")
    _require(s.kind in ("speed", "quality"), f"scenario.kind={s.kind!r}: allowed values are speed, quality")
    _require(s.kind == "quality" or bool(s.concurrency) or bool(s.rates) or bool(s.trace),
             f"scenario {s.name}: give scenario.concurrency (e.g. [1,4,16]) or scenario.rates")
    _require(all(c >= 1 for c in s.concurrency),
             f"scenario.concurrency={list(s.concurrency)}: every level must be an integer >= 1")
    _require(all(r > 0 for r in s.rates), f"scenario.rates={list(s.rates)}: every rate must be > 0")
    _require(s.api in ("completions", "chat"), f"scenario.api={s.api!r}: allowed values are completions, chat")
    _require(s.arrival in ("constant", "poisson"),
             f"scenario.arrival={s.arrival!r}: allowed values are constant, poisson")
    _require(s.max_concurrency is None or s.max_concurrency >= 1,
             f"scenario.max_concurrency={s.max_concurrency}: must be >= 1 (or null for no cap)")
    _in("scenario.max_start_rate", s.max_start_rate, 0, MAX_RATE, low_open=True, unit=" requests/s",
        null="no cap")
    bounds.check_levels(s)
    bounds.check_kv_types(cfg)
    check_search(s)
    scenario.check_scenario(s)
    caps = adapter_class(b.name).capabilities
    _require(not s.trace or (s.api == "completions" and caps.exact_prompts),
             f"scenario.trace: replaying a trace needs token-id prompts, the completions API of a backend with a "
             f"tokenizer endpoint (backend={b.name}, scenario.api={s.api})")
    check_client(cfg.client)
    label = job_label(cfg)  # every result, table and chart names the job by it; readers refuse longer ones
    _require(len(label) <= MAX_NAME_CHARS, f"the job's label is {len(label):,} characters (label, else "
             f"backend-model-kv-scenario), more than the {MAX_NAME_CHARS:,} a name may have: give a shorter label=")
    hidden = hidden_char(label)
    _require(hidden is None, f"the job's label {label!r} holds {label[hidden or 0]!r} at position {hidden}: it names "
             "files, log lines and tables, so only printable characters are allowed")
    placement.plan(cfg)  # client.placement=split where there is nothing to split
    check_known_keys(cfg)
    check_ranges(cfg)
    bounds.check_together(s)
    check_quality(cfg.quality, measured=cfg.quality.enabled or s.kind == "quality")
    _require(0.0 <= s.max_error_rate <= 1.0, f"scenario.max_error_rate={s.max_error_rate}: must be in [0, 1]")
    check_kv(b.name, kv, kv_choices)
    adapter_class(b.name).check_environment(b)
    _require(not serves or b.endpoint is not None or getattr(cfg.model, ref) is not None,
             f"model={cfg.model.name} has nothing for backend={b.name} to serve: set model.{ref}")


def check_known_keys(obj: Any, path: str = "") -> None:
    """Refuse keys no schema declares. Hydra's `+key=value` adds a key even to a structured config,
    and OmegaConf.to_object sets such a key as a plain attribute of the dataclass it builds; nothing
    reads it, so a typo like `+scenario.max_token=64` would run with the default unnoticed."""
    if not dataclasses.is_dataclass(obj):
        return
    fields = {f.name for f in dataclasses.fields(obj)}
    extra = sorted(k for k in vars(obj) if k not in fields and not k.startswith("_"))
    _require(not extra, f"{path}{extra[0] if extra else ''}: unknown key; allowed keys are {', '.join(sorted(fields))}")
    for name in sorted(fields):
        check_known_keys(getattr(obj, name), f"{path}{name}.")


def check_host(key: str, host: str) -> None:
    """An IP address literal or a DNS name (RFC 1123 labels)."""
    try:
        ipaddress.ip_address(host.strip("[]"))
        return
    except ValueError:
        pass
    name_ok = bool(host) and len(host) <= 253 and not re.fullmatch(r"[0-9.]+", host) and all(
        re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?", label) for label in host.rstrip(".").split("."))
    _require(name_ok, f"{key}={host!r}: not an IP address or host name (e.g. 127.0.0.1, ::1, localhost)")


def check_endpoint(key: str, url: str) -> None:
    parts = urlsplit(url)
    _require(parts.scheme in ("http", "https") and bool(parts.hostname),
             f"{key}={url!r}: must be an http:// or https:// URL with a host, e.g. http://127.0.0.1:8080")
    try:
        port = parts.port
    except ValueError:
        port = -1
    _require(port is None or 1 <= port <= 65535, f"{key}={url!r}: the port must be in 1..65535")
    check_host(key, parts.hostname or "")


def check_ranges(cfg: ExperimentConfig) -> None:
    """Every number within the range that can run, every address well-formed: refused at compose
    time with the key and the allowed range, instead of failing when the server or a socket refuses."""
    b, s, g, m = cfg.backend, cfg.scenario, cfg.gpu, cfg.model
    _in("backend.port", b.port, 1, 65535, null="a free port")
    check_host("backend.host", b.host)
    if b.endpoint is not None:
        check_endpoint("backend.endpoint", b.endpoint)
    _in("backend.ready_timeout_s", b.ready_timeout_s, 0, MAX_WAIT_S, low_open=True, unit=" s", why="a day")
    _in("backend.telemetry_interval_s", b.telemetry_interval_s, 0.001, MAX_POLL_S, unit=" s")
    _in("backend.stop_grace_s", b.stop_grace_s, 0, 3600)
    _in("backend.parallel", b.parallel, 1, MAX_STREAMS, null="the backend's default")
    _in("backend.context", b.context, 1, 1 << 24, null="derived from the scenario")
    for key, hi in (("threads", MAX_THREADS), ("block_size", MAX_BLOCK), ("kv_cache_memory_bytes", MAX_KV_BYTES)):
        if hasattr(b, key):
            _in(f"backend.{key}", getattr(b, key), 1, hi, null="the backend's default")
    if hasattr(b, "tensor_parallel"):
        _in("backend.tensor_parallel", b.tensor_parallel, 1, 1024)
    if hasattr(b, "n_gpu_layers"):
        _in("backend.n_gpu_layers", b.n_gpu_layers, -1, MAX_LAYERS, null="the backend's default")
    if hasattr(b, "gpu_memory_utilization"):
        _in("backend.gpu_memory_utilization", b.gpu_memory_utilization, 0, 1, low_open=True,
            null="the backend's default")
    lg = cfg.log
    for key in ("max_mb", "lines_max_mb"):
        _in(f"log.{key}", getattr(lg, key), bounds.MIN_LOG_MB, bounds.MAX_LOG_MB, null="no cap", unit=" MiB")
    _in("log.head_mb", lg.head_mb, 0, (lg.max_mb or bounds.MAX_LOG_MB) / 2, low_open=True, unit=" MiB",
        why="half of log.max_mb, so that the latest output has room")
    _in("gpu.memory_gib", g.memory_gib, 0, MAX_GIB, low_open=True, null="read from NVML")
    _in("gpu.index", g.index, 0, 1023)
    _in("gpu.sample_interval_s", g.sample_interval_s, 0.001, 60)
    for key in ("n_layers", "n_kv_heads", "head_dim"):
        _in(f"model.{key}", getattr(m, key), 1, MAX_LAYERS, null="read from the model files")
    _in("model.sliding_window", m.sliding_window, 1, MAX_TOKENS, null="read from the model files")
    _in("model.sliding_layers", m.sliding_layers, 0, m.n_layers or MAX_LAYERS, null="read from the model files")
    for key, hi, why in (("params_b", MAX_PARAMS_B, "100 trillion parameters"), ("weights_gib", MAX_GIB, "a PiB"),
                         ("weight_bits", MAX_WEIGHT_BITS, "bits per parameter")):
        _in(f"model.{key}", getattr(m, key), 0, hi, low_open=True, null="read from the model files", why=why)
    _require(not (s.concurrency and s.rates),
             f"scenario.concurrency={list(s.concurrency)} and scenario.rates={list(s.rates)} are both set: give one "
             "(for rates, add scenario.concurrency=[])")
    _require(all(1 <= c <= MAX_STREAMS for c in s.concurrency),
             f"scenario.concurrency={list(s.concurrency)}: every level must be an integer in 1..{MAX_STREAMS:,}")
    _require(all(0 < r <= MAX_RATE for r in s.rates),
             f"scenario.rates={list(s.rates)}: every rate must be > 0 and <= {_num(MAX_RATE)} requests/s")
    _in("scenario.max_concurrency", s.max_concurrency, 1, MAX_STREAMS, null="no cap")
    _in("scenario.prompt_tokens", s.prompt_tokens, 1, MAX_TOKENS)
    _in("scenario.max_tokens", s.max_tokens, 1, MAX_TOKENS)
    _in("scenario.requests", s.requests, 1, MAX_REQUESTS)
    _in("scenario.warmup_requests", s.warmup_requests, 0, MAX_WARMUP,
        why="a warm-up only wakes the server and is not measured; measure more with scenario.requests")
    _in("scenario.repeats", s.repeats, 1, MAX_REPEATS)
    for key in ("request_timeout_s", "stall_timeout_s"):
        _in(f"scenario.{key}", getattr(s, key), 0, MAX_WAIT_S, low_open=True, unit=" s", why="a day")
    for key, what in (("slo_ttft_ms", "no TTFT objective"), ("slo_tpot_ms", "no TPOT objective")):
        _in(f"scenario.{key}", getattr(s, key), 0, MAX_SLO_MS, low_open=True, null=what, unit=" ms", why="a day")
    check_fits_context(cfg)


def check_fits_context(cfg: ExperimentConfig) -> None:
    """A request must fit the context each sequence gets, or every request of every level fails with
    HTTP 400. The context per sequence is the adapter's (llama.cpp splits -c over its slots, vLLM and
    Ollama give each sequence the whole context)."""
    b, s = cfg.backend, cfg.scenario
    if b.context is None or b.endpoint is not None:
        return
    try:
        spec = adapter_class(b.name)(cfg, None, None).spec
    except ConfigError:
        return  # the config has another problem, reported on its own
    per_seq = spec.context_per_seq_tokens
    if per_seq is None:
        return
    need = scenario.longest_sequence(s)
    slots = spec.slots or 1
    split = per_seq < (spec.context_tokens or per_seq)
    where = f"backend.context={b.context}" + (f" over {slots} slots (backend.parallel)" if split else "")
    what = ("scenario.prompt_tokens + scenario.max_tokens" if scenario.kind(s) == "synthetic" and need ==
            s.prompt_tokens + s.max_tokens else "the scenario's longest request (prompt and output)")
    _require(need <= per_seq, f"{what} = {need} tokens do not fit the "
             f"{per_seq} tokens per sequence of {where}: raise backend.context or shorten the scenario")


def check_search(s: ScenarioConfig) -> None:
    """An SLO search needs its kind's levels, an objective, a known percentile and a positive step."""
    _require(s.slo_percentile in ("p50", "p95", "p99"),
             f"scenario.slo_percentile={s.slo_percentile!r}: allowed values are p50, p95, p99")
    if s.search is None:
        return
    _require(s.search in ("concurrency", "rate"),
             f"scenario.search={s.search!r}: allowed values are concurrency, rate (or null)")
    levels = s.concurrency if s.search == "concurrency" else s.rates
    _require(bool(levels) and (s.search == "rate" or not s.rates),
             f"scenario.search={s.search}: give the grid to search as "
             f"scenario.{'concurrency' if s.search == 'concurrency' else 'rates'}"
             + (" (and no scenario.rates)" if s.search == "concurrency" else ""))
    _require(s.slo_ttft_ms is not None or s.slo_tpot_ms is not None,
             f"scenario.search={s.search}: give scenario.slo_ttft_ms and/or scenario.slo_tpot_ms to search against")
    bounds.check_grid(s)


def check_client(c: ClientConfig) -> None:
    bounds.check_workers(c)
    _require(c.event_loop in ("auto", "asyncio", "uvloop"),
             f"client.event_loop={c.event_loop!r}: allowed values are auto, asyncio, uvloop")


def check_quality(q: QualityConfig, measured: bool = True) -> None:
    """The quality settings in range; when the job measures no quality (measured=False: neither
    quality.enabled nor a quality scenario), none changed from its default, as none would be read."""
    _require(bool(q.depths) and all(d >= 16 for d in q.depths),
             f"quality.depths={list(q.depths)}: give context depths of at least 16 tokens, e.g. [512,2048]")
    _require(len(q.depths) <= MAX_DEPTHS and all(d <= MAX_TOKENS for d in q.depths),
             f"quality.depths={list(q.depths)}: allowed at most {MAX_DEPTHS} depths of 16..{MAX_TOKENS:,} tokens")
    for key, hi in (("chunks", MAX_CHUNKS), ("prompts", MAX_PROMPTS), ("prompt_tokens", MAX_TOKENS),
                    ("max_tokens", MAX_TOKENS), ("top_k", MAX_TOP_K)):
        _in(f"quality.{key}", getattr(q, key), 1, hi)
    _require((data_dir("conf") / "kv" / f"{q.baseline}.yaml").is_file(),
             f"quality.baseline={q.baseline}: no such KV option (one of conf/kv/*.yaml, e.g. fp16)")
    problem = None if q.text is None else file_problem(Path(q.text).expanduser())
    _require(problem is None,
             f"quality.text={q.text}: {problem} (give a UTF-8 text file, or leave it unset for kvexp's own)")
    defaults = QualityConfig()
    for f in dataclasses.fields(QualityConfig):
        value = getattr(q, f.name)
        _require(measured or f.name == "enabled" or value == getattr(defaults, f.name),
                 f"quality.{f.name}={value}: read only when the job measures quality, and this one does not; "
                 "allowed: quality.enabled=true (or scenario=quality), or leave quality.* unset")
