"""Typed configuration: the schemas live here, the choices live in conf/*.yaml.

Hydra composes YAML over these dataclasses (a typo or a wrong type fails at compose time); the CLI
converts the result with OmegaConf.to_object and everything below it receives these objects."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit

from omegaconf import MISSING

class ConfigError(ValueError):
    """A configuration that cannot run; the message is one line naming the key and what is allowed."""


# Closed sets of values are enums: OmegaConf refuses any other value at compose time, naming the key
# and the allowed values. They are str enums, so they compare, format and serialise as their value.
class FlashAttn(StrEnum):
    on = "on"
    off = "off"
    auto = "auto"


class KVRotation(StrEnum):
    """llama.cpp's rotation of quantised K/V (a Hadamard transform before quantising): auto is the
    build's default (on for quantised types whose head size is a multiple of 64), off sets
    LLAMA_ATTN_ROT_DISABLE=1 for the server and llama-perplexity."""

    auto = "auto"
    off = "off"


class Api(StrEnum):
    completions = "completions"
    chat = "chat"


class Arrival(StrEnum):
    constant = "constant"
    poisson = "poisson"


class Unsupported(StrEnum):
    error = "error"
    skip = "skip"


class DistKind(StrEnum):
    fixed = "fixed"
    uniform = "uniform"
    normal = "normal"
    lognormal = "lognormal"
    histogram = "histogram"


class EventLoop(StrEnum):
    auto = "auto"
    asyncio = "asyncio"
    uvloop = "uvloop"


# Upper bounds of what one job can sensibly ask: beyond them a value is a typo, not an experiment.
MAX_STREAMS = 4096  # concurrent requests of a level (each is a socket and a server slot)
MAX_TOKENS = 1 << 20  # prompt or output tokens of one request
MAX_REQUESTS = 1_000_000  # requests per level
MAX_RATE = 100_000.0  # requests per second of an open-loop level


@dataclass
class BackendConfig:
    name: str = MISSING
    # Attach to a running server instead of launching one (e.g. http://127.0.0.1:8080).
    endpoint: Optional[str] = None
    host: str = "127.0.0.1"
    port: Optional[int] = None  # None: a free port is chosen
    # Name of an environment variable holding an API key for a remote endpoint (never written out).
    api_key_env: Optional[str] = None
    ready_timeout_s: float = 120.0
    stop_grace_s: float = 10.0
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # Concurrent sequences the server runs at once (llama.cpp -np, vLLM --max-num-seqs,
    # Ollama OLLAMA_NUM_PARALLEL). None: the backend's own default / derived from the scenario.
    parallel: Optional[int] = None
    # Context length (llama.cpp total -c; vLLM --max-model-len; Ollama OLLAMA_CONTEXT_LENGTH).
    context: Optional[int] = None
    # How often the server's own gauges (KV usage, running/waiting) are polled during a level, from a
    # process of its own (kvexp/telemetry.py).
    telemetry_interval_s: float = 0.02

    def kv_tag(self) -> str:
        """What a job's label adds to its KV dtype for a setting that changes the KV's numbers ("": none)."""
        return ""


@dataclass
class ModelConfig:
    name: str = MISSING
    # What each backend serves. "@tiny" means the tiny model kvexp makes itself.
    gguf: Optional[str] = None  # llama.cpp: path to a .gguf file
    hf: Optional[str] = None  # vLLM: local directory or Hugging Face id
    ollama: Optional[str] = None  # Ollama: model tag
    # Architecture for the planner (presets); None: read from the model files where possible.
    n_layers: Optional[int] = None
    n_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    params_b: Optional[float] = None
    weights_gib: Optional[float] = None
    weight_bits: Optional[float] = None  # bits per parameter of the weights (e.g. 4.5 for Q4_K_M)


@dataclass
class KVConfig:
    name: str = MISSING  # portable name: fp16, bf16, fp8, q8_0, q4_0 (bytes per element: planner.py)
    # The backend's own spelling of this dtype; a backend missing here cannot use it.
    per_backend: dict[str, str] = field(default_factory=dict)


@dataclass
class LengthDist:
    """How the lengths of a scenario's prompts or outputs spread around the scenario's own figure
    (prompt_tokens or max_tokens, "the centre"): fixed (every request the centre), uniform over
    [min, max], normal with mean the centre and std, lognormal with median the centre and sigma (of
    the log), or an empirical histogram (lengths `bins` drawn with `weights`). normal and lognormal
    are clipped to [min, max], which they must give. Sampled seeded (scenario.seed) in kvexp/workload.py."""

    kind: DistKind = DistKind.fixed
    min: Optional[int] = None
    max: Optional[int] = None
    std: Optional[float] = None
    sigma: Optional[float] = None
    bins: list[int] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)


@dataclass
class ConversationConfig:
    """Multi-turn conversations: with turns > 1 each of a level's `requests` is a conversation of this
    many turns; every turn sends the whole history (earlier prompts and the server's own answers)
    plus a new user message of a prompt length, after a think time (exponential with this mean,
    seeded; 0: none). A level's concurrency is the number of conversations in flight."""

    turns: int = 1
    think_time_s: float = 0.0


@dataclass
class ScenarioConfig:
    name: str = MISSING
    # speed: measure the levels below; quality: no speed levels, only the quality measurement
    # (quality.*), e.g. scenario=quality
    kind: str = "speed"
    prompt_tokens: int = MISSING
    max_tokens: int = MISSING
    # The user's traffic (kvexp/workload.py): length distributions around prompt_tokens / max_tokens,
    # shared prefixes, multi-turn conversations, a dataset of prompts or a timed trace to replay.
    prompt_dist: LengthDist = field(default_factory=LengthDist)
    output_dist: LengthDist = field(default_factory=LengthDist)
    # each request starts with one of prefix_groups shared prefixes of prefix_tokens tokens (part of
    # its prompt length), then its own unique part; which group is seeded
    prefix_tokens: int = 0
    prefix_groups: int = 1
    conversation: ConversationConfig = field(default_factory=ConversationConfig)
    # a JSONL of prompts or conversations ({"messages": [...]}, ShareGPT's {"conversations": [...]} or
    # {"prompt": "..."}); "@name" is one kvexp ships (kvexp/datasets/). A level sends `requests` of
    # them in file order (cycling); prompts over prompt_tokens tokens are left out and counted.
    dataset: Optional[str] = None
    # a timed trace (Mooncake's JSONL: timestamp ms, input_length, output_length, hash_ids): one
    # open-loop level replays its first `requests` rows at their own times x time_scale
    trace: Optional[str] = None
    time_scale: float = 1.0
    trace_block_tokens: int = 512  # tokens per hash id (Mooncake: 512)
    # reset the server's prefix cache before each level where the backend allows it (the result says
    # what was done), so one level cannot warm the next
    reset_cache: bool = True
    concurrency: list[int] = field(default_factory=list)
    # Open-loop levels (requests/s); used instead of concurrency when non-empty.
    rates: list[float] = field(default_factory=list)
    arrival: Arrival = Arrival.constant  # open loop only
    max_concurrency: Optional[int] = None  # cap on in-flight requests for open-loop levels
    # Cap on request starts per second, open and closed loop (asyncio-throttle), e.g. for a shared
    # endpoint; a request held back waits on the client (client_queue_*). None: no cap.
    max_start_rate: Optional[float] = None
    requests: int = MISSING  # measured requests per level
    warmup_requests: int = 1
    repeats: int = 1
    api: Api = Api.completions
    request_timeout_s: float = 600.0
    stall_timeout_s: float = 120.0  # no bytes for this long: the request is a timeout
    seed: int = 0
    # Service-level objectives for goodput (None: not used).
    slo_ttft_ms: Optional[float] = None
    slo_tpot_ms: Optional[float] = None
    max_error_rate: float = 0.1  # a level above this error rate is marked failed
    # SLO search (kvexp/search.py): concurrency | rate finds the highest level of the grid (the levels
    # above, filled every search_resolution when set) whose slo_percentile TTFT/TPOT meet the objectives.
    search: Optional[str] = None
    slo_percentile: str = "p95"  # p50 | p95 | p99
    search_resolution: Optional[float] = None
    # stop ramping when throughput grows less than this over the previous level (null: never)
    search_min_growth: Optional[float] = 0.05


@dataclass
class ClientConfig:
    """How the load generator sends requests (not what it sends). Recorded in every result."""

    # Processes that send a level's requests, each with its own event loop and session: a number
    # (1: the job's own event loop), or auto: one per 64 concurrent streams, at most the cores kvexp
    # may use less two; on 4 or more cores even a single loop gets a process of its own, below that it
    # is the job's own loop.
    workers: Any = "auto"
    # Event loop of worker processes: auto (uvloop when installed), asyncio or uvloop. uvloop with
    # workers=1 starts one worker process, since the job's own loop is asyncio.
    event_loop: EventLoop = EventLoop.auto


def highest_concurrency(s: "ScenarioConfig") -> int:
    """Most requests a scenario can have in flight at once (servers get this many slots by default)."""
    return max([*s.concurrency, s.max_concurrency or 1, 1])


OPEN_LOOP_SLOTS = 16  # a slotted server's sequences for open-loop levels with no cap (backend.parallel)


def server_slots(s: "ScenarioConfig", parallel: Optional[int]) -> tuple[int, str]:
    """Sequences a slotted server (llama.cpp -np, OLLAMA_NUM_PARALLEL) runs at once, and where that
    came from: backend.parallel, else the scenario's highest concurrency (or its max_concurrency cap),
    else, for open-loop levels with no cap, OPEN_LOOP_SLOTS."""
    if parallel:
        return parallel, "backend.parallel"
    if s.concurrency or s.max_concurrency:
        return highest_concurrency(s), "derived: highest concurrency level"
    return OPEN_LOOP_SLOTS, f"kvexp's default for open-loop levels without max_concurrency ({OPEN_LOOP_SLOTS})"


def client_connections(s: "ScenarioConfig") -> Optional[int]:
    """The load generator's connection pool: a closed loop's streams (+4 for the probes); None (no
    limit) for open-loop levels without max_concurrency, so the pool never holds back a schedule."""
    if s.concurrency or s.max_concurrency:
        return highest_concurrency(s) + 4
    return None


@dataclass
class QualityConfig:
    """What a KV dtype costs in quality: drift from the 16-bit KV cache (kvexp/quality.py). Runs
    after a job's speed levels when enabled, and is all a job of a `kind: quality` scenario does."""

    enabled: bool = False
    text: Optional[str] = None  # evaluation text file; None: kvexp's own (kvexp/evaltext.txt)
    # Teacher-forced drift: context depths (tokens per window; the second half of each is scored)
    depths: list[int] = field(default_factory=lambda: [512, 2048, 4096])
    chunks: int = 4  # windows per depth, at most (the text's length may allow fewer)
    # Greedy-continuation agreement through the serving API
    prompts: int = 8
    prompt_tokens: int = 64
    max_tokens: int = 32
    top_k: int = 10  # log-probabilities asked per position where only top-k is exposed
    seed: int = 0
    baseline: str = "fp16"  # the KV dtype every other one is compared with
    cache: bool = True  # keep the baseline's outputs (per backend, model, build) for later jobs


@dataclass
class GPUConfig:
    name: Optional[str] = None  # None: read from NVML
    memory_gib: Optional[float] = None  # None: read from NVML
    index: int = 0
    sample_interval_s: float = 0.1


@dataclass
class ExperimentConfig:
    backend: BackendConfig = MISSING
    model: ModelConfig = MISSING
    kv: KVConfig = MISSING
    scenario: ScenarioConfig = MISSING
    gpu: GPUConfig = field(default_factory=GPUConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    quality: QualityConfig = field(default_factory=QualityConfig)
    # What to do with a backend/kv pair that cannot run: error (stop at start) or skip (record why).
    unsupported: Unsupported = Unsupported.error
    resume: bool = False
    output_dir: str = "."  # set by Hydra to the job folder
    label: Optional[str] = None


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="experiment_schema", node=ExperimentConfig)
    from kvexp.backends import REGISTRY  # each backend's schema lives beside its adapter

    for adapter in REGISTRY.values():
        cs.store(group="backend", name=f"{adapter.name}_schema", node=adapter.config_class)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="kv", name="kv_schema", node=KVConfig)
    cs.store(group="scenario", name="scenario_schema", node=ScenarioConfig)
    cs.store(group="gpu", name="gpu_schema", node=GPUConfig)


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def check_config(cfg: ExperimentConfig, kv_choices: dict[str, KVConfig] | None = None) -> None:
    """Semantic checks Hydra's typing cannot make. Raises ConfigError with one line."""
    from kvexp.backends import adapter_class

    b, s, kv = cfg.backend, cfg.scenario, cfg.kv
    ref = adapter_class(b.name).model_field
    _require(cfg.unsupported in ("error", "skip"),
             f"unsupported={cfg.unsupported!r}: allowed values are error, skip")
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
    _require(s.max_start_rate is None or s.max_start_rate > 0,
             f"scenario.max_start_rate={s.max_start_rate}: must be > 0 requests/s (or null for no cap)")
    check_search(s)
    from kvexp import workload

    workload.check_scenario(s)
    caps = adapter_class(b.name).capabilities
    _require(not s.trace or (s.api == "completions" and caps.exact_prompts),
             f"scenario.trace: replaying a trace needs token-id prompts, the completions API of a backend with a "
             f"tokenizer endpoint (backend={b.name}, scenario.api={s.api})")
    check_client(cfg.client)
    check_known_keys(cfg)
    check_ranges(cfg)
    check_quality(cfg.quality)
    _require(0.0 <= s.max_error_rate <= 1.0, f"scenario.max_error_rate={s.max_error_rate}: must be in [0, 1]")
    check_kv(b.name, kv, kv_choices)
    adapter_class(b.name).check_environment(b)
    _require(b.endpoint is not None or getattr(cfg.model, ref) is not None,
             f"model={cfg.model.name} has nothing for backend={b.name} to serve: set model.{ref}")


def check_known_keys(obj: Any, path: str = "") -> None:
    """Refuse keys no schema declares. Hydra's `+key=value` adds a key even to a structured config,
    and OmegaConf.to_object sets such a key as a plain attribute of the dataclass it builds; nothing
    reads it, so a typo like `+scenario.max_token=64` would run with the default unnoticed."""
    import dataclasses

    if not dataclasses.is_dataclass(obj):
        return
    fields = {f.name for f in dataclasses.fields(obj)}
    extra = sorted(k for k in vars(obj) if k not in fields and not k.startswith("_"))
    _require(not extra, f"{path}{extra[0] if extra else ''}: unknown key; allowed keys are {', '.join(sorted(fields))}")
    for name in sorted(fields):
        check_known_keys(getattr(obj, name), f"{path}{name}.")


def _in(key: str, value: Any, lo: float, hi: float | None = None, *, low_open: bool = False,
        null: str | None = None) -> None:
    """value within [lo, hi] ((lo, hi] with low_open); None allowed when `null` says what it means."""
    if value is None and null is not None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    ok = ok and (value > lo if low_open else value >= lo) and (hi is None or value <= hi)
    lo_s = f"> {_num(lo)}" if low_open else f">= {_num(lo)}"
    allowed = f"{lo_s} and <= {_num(hi)}" if hi is not None else lo_s
    _require(ok, f"{key}={value}: must be {allowed}" + (f" (or null: {null})" if null else ""))


def _num(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"


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
    _in("backend.ready_timeout_s", b.ready_timeout_s, 0, low_open=True)
    _in("backend.stop_grace_s", b.stop_grace_s, 0, 3600)
    _in("backend.parallel", b.parallel, 1, MAX_STREAMS, null="the backend's default")
    _in("backend.context", b.context, 1, 1 << 24, null="derived from the scenario")
    for key in ("threads", "block_size", "kv_cache_memory_bytes"):
        if hasattr(b, key):
            _in(f"backend.{key}", getattr(b, key), 1, null="the backend's default")
    if hasattr(b, "n_gpu_layers"):
        _in("backend.n_gpu_layers", b.n_gpu_layers, -1, null="the backend's default")
    if hasattr(b, "gpu_memory_utilization"):
        _in("backend.gpu_memory_utilization", b.gpu_memory_utilization, 0, 1, low_open=True,
            null="the backend's default")
    _in("gpu.memory_gib", g.memory_gib, 0, 1 << 20, low_open=True, null="read from NVML")
    _in("gpu.index", g.index, 0, 1023)
    _in("gpu.sample_interval_s", g.sample_interval_s, 0.001, 60)
    for key in ("n_layers", "n_kv_heads", "head_dim"):
        _in(f"model.{key}", getattr(m, key), 1, null="read from the model files")
    for key in ("params_b", "weights_gib", "weight_bits"):
        _in(f"model.{key}", getattr(m, key), 0, low_open=True, null="read from the model files")
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
    _in("scenario.warmup_requests", s.warmup_requests, 0, MAX_REQUESTS)
    _in("scenario.repeats", s.repeats, 1, 1000)
    _in("scenario.request_timeout_s", s.request_timeout_s, 0, low_open=True)
    _in("scenario.stall_timeout_s", s.stall_timeout_s, 0, low_open=True)
    _in("scenario.slo_ttft_ms", s.slo_ttft_ms, 0, low_open=True, null="no TTFT objective")
    _in("scenario.slo_tpot_ms", s.slo_tpot_ms, 0, low_open=True, null="no TPOT objective")
    check_fits_context(cfg)


def check_fits_context(cfg: ExperimentConfig) -> None:
    """A request must fit the context each sequence gets, or every request of every level fails with
    HTTP 400. The context per sequence is the adapter's (llama.cpp splits -c over its slots, vLLM and
    Ollama give each sequence the whole context)."""
    from kvexp.backends import adapter_class

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
    from kvexp import workload

    need = workload.longest_sequence(s)
    slots = spec.slots or 1
    split = per_seq < (spec.context_tokens or per_seq)
    where = f"backend.context={b.context}" + (f" over {slots} slots (backend.parallel)" if split else "")
    what = ("scenario.prompt_tokens + scenario.max_tokens" if workload.kind(s) == "synthetic" and need ==
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
             f"scenario.search={s.search}: give the grid to search as scenario.{'concurrency' if s.search == 'concurrency' else 'rates'}"
             + (" (and no scenario.rates)" if s.search == "concurrency" else ""))
    _require(s.slo_ttft_ms is not None or s.slo_tpot_ms is not None,
             f"scenario.search={s.search}: give scenario.slo_ttft_ms and/or scenario.slo_tpot_ms to search against")
    _require(s.search_min_growth is None or s.search_min_growth >= 0,
             f"scenario.search_min_growth={s.search_min_growth}: must be >= 0 (or null: never stop on a plateau)")
    _require(s.search_resolution is None or s.search_resolution > 0,
             f"scenario.search_resolution={s.search_resolution}: must be > 0 (or null: the grid as given)")


def check_client(c: ClientConfig) -> None:
    w = c.workers
    _require(w == "auto" or (isinstance(w, int) and not isinstance(w, bool) and w >= 1),
             f"client.workers={w!r}: allowed values are auto or a number >= 1")
    _require(c.event_loop in ("auto", "asyncio", "uvloop"),
             f"client.event_loop={c.event_loop!r}: allowed values are auto, asyncio, uvloop")


def check_quality(q: QualityConfig) -> None:
    _require(bool(q.depths) and all(d >= 16 for d in q.depths),
             f"quality.depths={list(q.depths)}: give context depths of at least 16 tokens, e.g. [512,2048]")
    for key in ("chunks", "prompts", "prompt_tokens", "max_tokens", "top_k"):
        v = getattr(q, key)
        _require(v >= 1, f"quality.{key}={v}: must be >= 1")
    from kvexp.paths import data_dir

    _require((data_dir("conf") / "kv" / f"{q.baseline}.yaml").is_file(),
             f"quality.baseline={q.baseline}: no such KV option (one of conf/kv/*.yaml, e.g. fp16)")
    _require(q.text is None or Path(q.text).expanduser().is_file(),
             f"quality.text={q.text}: no such file (give a UTF-8 text file, or leave it unset for kvexp's own)")


def check_kv(backend: str, kv: KVConfig, kv_choices: dict[str, KVConfig] | None = None) -> None:
    if backend in kv.per_backend:
        return
    allowed = sorted(n for n, k in (kv_choices or {}).items() if backend in k.per_backend)
    hint = f" (allowed for {backend}: {', '.join(allowed)})" if allowed else ""
    raise ConfigError(f"kv={kv.name} is not available on backend={backend}{hint}")


def job_label(cfg: ExperimentConfig) -> str:
    kv = cfg.kv.name + cfg.backend.kv_tag()
    return cfg.label or f"{cfg.backend.name}-{cfg.model.name}-{kv}-{cfg.scenario.name}"


def to_plain(obj: Any) -> Any:
    """Dataclass tree -> JSON-ready dict (for results)."""
    import dataclasses

    if dataclasses.is_dataclass(obj):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj
