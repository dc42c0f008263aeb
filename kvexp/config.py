"""Typed configuration: the schemas live here, the choices live in conf/*.yaml.

Hydra composes YAML over these dataclasses (a typo or a wrong type fails at compose time); the CLI
converts the result with OmegaConf.to_object and everything below it receives these objects."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING

BACKENDS = ("llamacpp", "vllm", "ollama")


class ConfigError(ValueError):
    """A configuration that cannot run; the message is one line naming the key and what is allowed."""


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


@dataclass
class LlamaCppConfig(BackendConfig):
    name: str = "llamacpp"
    binary: Optional[str] = None  # path or name on PATH; None: PATH, then kvexp's cached build
    threads: Optional[int] = None
    n_gpu_layers: Optional[int] = None
    flash_attn: str = "on"  # on | off | auto


@dataclass
class VLLMConfig(BackendConfig):
    name: str = "vllm"
    python: Optional[str] = None  # interpreter with vLLM installed; None: kvexp's venv, then sys.executable
    dtype: Optional[str] = None  # model dtype (--dtype)
    gpu_memory_utilization: Optional[float] = 0.9
    kv_cache_memory_bytes: Optional[int] = None
    block_size: Optional[int] = None
    enforce_eager: bool = False


@dataclass
class OllamaConfig(BackendConfig):
    name: str = "ollama"
    binary: Optional[str] = None  # `ollama` on PATH by default
    flash_attention: bool = True


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
    name: str = MISSING  # portable name: fp16, bf16, fp8, q8_0, q4_0
    bytes_per_element: float = MISSING
    # The backend's own spelling of this dtype; a backend missing here cannot use it.
    per_backend: dict[str, str] = field(default_factory=dict)


@dataclass
class ScenarioConfig:
    name: str = MISSING
    # speed: measure the levels below; quality: no speed levels, only the quality measurement
    # (quality.*), e.g. scenario=quality
    kind: str = "speed"
    prompt_tokens: int = MISSING
    max_tokens: int = MISSING
    concurrency: list[int] = field(default_factory=list)
    # Open-loop levels (requests/s); used instead of concurrency when non-empty.
    rates: list[float] = field(default_factory=list)
    arrival: str = "constant"  # constant | poisson (open loop only)
    max_concurrency: Optional[int] = None  # cap on in-flight requests for open-loop levels
    # Cap on request starts per second, open and closed loop (asyncio-throttle), e.g. for a shared
    # endpoint; a request held back waits on the client (client_queue_*). None: no cap.
    max_start_rate: Optional[float] = None
    requests: int = MISSING  # measured requests per level
    warmup_requests: int = 1
    repeats: int = 1
    api: str = "completions"  # completions | chat
    request_timeout_s: float = 600.0
    stall_timeout_s: float = 120.0  # no bytes for this long: the request is a timeout
    seed: int = 0
    # Service-level objectives for goodput (None: not used).
    slo_ttft_ms: Optional[float] = None
    slo_tpot_ms: Optional[float] = None
    max_error_rate: float = 0.1  # a level above this error rate is marked failed


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
    event_loop: str = "auto"


def highest_concurrency(s: "ScenarioConfig") -> int:
    """Most requests a scenario can have in flight at once (servers get this many slots by default)."""
    return max([*s.concurrency, s.max_concurrency or 1, 1])


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
    unsupported: str = "error"
    resume: bool = False
    output_dir: str = "."  # set by Hydra to the job folder
    label: Optional[str] = None


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="experiment_schema", node=ExperimentConfig)
    cs.store(group="backend", name="llamacpp_schema", node=LlamaCppConfig)
    cs.store(group="backend", name="vllm_schema", node=VLLMConfig)
    cs.store(group="backend", name="ollama_schema", node=OllamaConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="kv", name="kv_schema", node=KVConfig)
    cs.store(group="scenario", name="scenario_schema", node=ScenarioConfig)
    cs.store(group="gpu", name="gpu_schema", node=GPUConfig)


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def check_config(cfg: ExperimentConfig, kv_choices: dict[str, KVConfig] | None = None) -> None:
    """Semantic checks Hydra's typing cannot make. Raises ConfigError with one line."""
    b, s, kv = cfg.backend, cfg.scenario, cfg.kv
    _require(b.name in BACKENDS, f"backend.name={b.name!r}: allowed values are {', '.join(BACKENDS)}")
    _require(cfg.unsupported in ("error", "skip"),
             f"unsupported={cfg.unsupported!r}: allowed values are error, skip")
    _require(s.prompt_tokens >= 1, f"scenario.prompt_tokens={s.prompt_tokens}: must be >= 1")
    _require(s.max_tokens >= 1, f"scenario.max_tokens={s.max_tokens}: must be >= 1")
    _require(s.requests >= 1, f"scenario.requests={s.requests}: must be >= 1")
    _require(s.warmup_requests >= 0, f"scenario.warmup_requests={s.warmup_requests}: must be >= 0")
    _require(s.repeats >= 1, f"scenario.repeats={s.repeats}: must be >= 1")
    _require(s.kind in ("speed", "quality"), f"scenario.kind={s.kind!r}: allowed values are speed, quality")
    _require(s.kind == "quality" or bool(s.concurrency) or bool(s.rates),
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
    check_client(cfg.client)
    check_quality(cfg.quality)
    _require(0.0 <= s.max_error_rate <= 1.0, f"scenario.max_error_rate={s.max_error_rate}: must be in [0, 1]")
    check_kv(b.name, kv, kv_choices)
    ref = {"llamacpp": "gguf", "vllm": "hf", "ollama": "ollama"}[b.name]
    _require(b.endpoint is not None or getattr(cfg.model, ref) is not None,
             f"model={cfg.model.name} has nothing for backend={b.name} to serve: set model.{ref}")


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
    return cfg.label or f"{cfg.backend.name}-{cfg.model.name}-{cfg.kv.name}-{cfg.scenario.name}"


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
