"""Typed configuration: the schemas live here, the choices live in conf/*.yaml.

Hydra composes YAML over these dataclasses (a typo or a wrong type fails at compose time); the CLI
converts the result with OmegaConf.to_object and everything below it receives these objects."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from enum import StrEnum
from typing import Any, Optional

MISSING = "???"  # OmegaConf's marker for a value the user must give (app/ hands this schema to Hydra)


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
    """What to do with a backend/kv pair that cannot run: auto (skip it in a sweep, stop a single run),
    error (stop, also a sweep, before anything runs) or skip (record it as skipped, also a single run)."""

    auto = "auto"
    error = "error"
    skip = "skip"


def skips_unsupported(policy: str, multirun: bool) -> bool:
    """Whether a job that cannot run is recorded as skipped (True) or stops the run (False)."""
    return policy == Unsupported.skip or (policy == Unsupported.auto and multirun)


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


class Placement(StrEnum):
    auto = "auto"
    split = "split"
    shared = "shared"


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
    # process of its own (kvexp/measure/telemetry.py).
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
    # Sliding-window attention: the window in tokens and how many layers use it (the rest keep every token)
    sliding_window: Optional[int] = None
    sliding_layers: Optional[int] = None
    # A model.hf hub id that is not in the local Hugging Face cache is downloaded by vLLM when its server
    # starts (said at the start of the run); false refuses such a job before anything runs.
    allow_download: bool = True


@dataclass
class KVConfig:
    name: str = MISSING  # portable name: fp16, bf16, fp8, q8_0, q4_0, ...; or a K/V pair "q8_0/q4_0" (K, then V)
    # The backend's own spelling of this dtype; a backend missing here cannot use it.
    per_backend: dict[str, str] = field(default_factory=dict)


@dataclass
class LengthDist:
    """How the lengths of a scenario's prompts or outputs spread around the scenario's own figure
    (prompt_tokens or max_tokens, "the centre"): fixed (every request the centre), uniform over
    [min, max], normal with mean the centre and std, lognormal with median the centre and sigma (of
    the log), or an empirical histogram (lengths `bins` drawn with `weights`). normal and lognormal
    are clipped to [min, max], which they must give. Sampled seeded (scenario.seed) in kvexp/workload/lengths.py."""

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
    # The user's traffic (kvexp/workload/): length distributions around prompt_tokens / max_tokens,
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
    # SLO search (kvexp/metrics/search.py): concurrency | rate finds the highest level of the grid (the levels
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
    # Where a server kvexp launches and the client run on this machine's CPUs (kvexp/core/placement.py):
    # split pins the server's process group to some CPUs and the client's loop and workers to the others;
    # shared lets both run anywhere; auto splits when there are 2 or more CPUs, unless the server places
    # its own threads (vLLM's CPU build).
    placement: Placement = Placement.auto


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
    """What a KV dtype costs in quality: drift from the 16-bit KV cache (kvexp/quality/measure.py). Runs
    after a job's speed levels when enabled, and is all a job of a `kind: quality` scenario does."""

    enabled: bool = False
    text: Optional[str] = None  # evaluation text file; None: kvexp's own (kvexp/assets/evaltext.txt)
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
class LogConfig:
    """What is kept on disk of the output of a server kvexp launches (kvexp/backends/serverlog.py). A
    llama-server at -lv 4 lists its whole prompt cache at every request: uncapped, 5,000 requests on the
    tiny model wrote 3.8 GB. Not part of a job's spec (its config hash): a resumed job may change it."""

    # server.log at most: its head, one line saying how many bytes were dropped, and the latest output
    # (null: no cap, the whole log)
    max_mb: Optional[float] = 8.0
    # of which the head: the launch, with the model's and the KV cache's lines
    head_mb: float = 2.0
    # <log>.lines.log at most: the lines kvexp reads back later, kept whole as they stream (llama-server's
    # per-request timings, Ollama's runner restarts), capped the same way (null: no cap)
    lines_max_mb: Optional[float] = 8.0


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
    log: LogConfig = field(default_factory=LogConfig)
    # What to do with a backend/kv pair that cannot run: auto (skip it in a sweep, refuse a single run),
    # error (stop at start, also a sweep) or skip (record why, also a single run).
    unsupported: Unsupported = Unsupported.auto
    resume: bool = False
    output_dir: str = "."  # set by Hydra to the job folder
    label: Optional[str] = None


def check_kv(backend: str, kv: KVConfig, kv_choices: dict[str, KVConfig] | None = None) -> None:
    if backend in kv.per_backend:
        return
    allowed = sorted(n for n, k in (kv_choices or {}).items() if backend in k.per_backend)
    hint = f" (allowed for {backend}: {', '.join(allowed)})" if allowed else ""
    if "/" in kv.name:
        raise ConfigError(f"kv={kv.name}: a K/V pair is not available on backend={backend}, which sets one KV cache "
                          f"type for K and V together{hint}")
    raise ConfigError(f"kv={kv.name} is not available on backend={backend}{hint}")


def job_label(cfg: ExperimentConfig) -> str:
    k, _, v = cfg.kv.name.partition("/")
    kv = (f"k{k}-v{v}" if v else k) + cfg.backend.kv_tag()  # a K/V pair q8_0/q4_0: kq8_0-vq4_0
    return cfg.label or f"{cfg.backend.name}-{cfg.model.name}-{kv}-{cfg.scenario.name}"


def to_plain(obj: Any) -> Any:
    """Dataclass tree -> JSON-ready dict (for results)."""
    if is_dataclass(obj):
        return {f.name: to_plain(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj
