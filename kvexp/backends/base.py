"""The contract every backend adapter implements (`Adapter`), the server it resolves (`ServerSpec`),
and the data it hands back.

An adapter is mostly pure: the argv and environment to launch its server, the URL paths to probe,
the JSON body of a streaming request, how to parse one stream line, and how to read the server's own
telemetry. Timing is not the adapter's business: the load generator owns the clock."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional, Union

import aiohttp

from kvexp.capacity.cpumemory import CpuMemoryModel, ServerBuffers
from kvexp.capacity.planner import CacheModel, kv_bytes_per_element
from kvexp.core.config import BackendConfig, ConfigError, ExperimentConfig, check_kv
from kvexp.core import placement
from kvexp.workload.prompts import TextUnits


class BackendError(RuntimeError):
    """A backend did something kvexp cannot work with; the message is one line."""


async def answer_json(r: aiohttp.ClientResponse, shape: type = dict, **fields: type) -> Any:
    """A server's JSON answer in the shape kvexp reads: `shape` (dict, or list), and each of `fields`
    present with its type in the dict, or in every item of the list (then each an object); whatever its
    content type. Anything else (an endpoint that is not the server it was named as, a proxy's error
    page) is a BackendError naming the URL."""
    try:
        body = await r.json(content_type=None)
    except ValueError:
        raise BackendError(f"{r.method} {r.url} answered HTTP {r.status} with a body that is not JSON: "
                           f"{(await r.text(errors='replace'))[:80]!r}") from None
    if not isinstance(body, shape):
        wrong: Optional[str] = f"a JSON {type(body).__name__} where a {shape.__name__} was expected"
    else:
        wrong = next((f"an object without {k!r} ({t.__name__})" for o in ([body] if shape is dict else body)
                      for k, t in fields.items() if not (isinstance(o, dict) and isinstance(o.get(k), t))), None)
    if wrong:
        raise BackendError(f"{r.method} {r.url} answered HTTP {r.status} with {wrong}")
    return body


async def reported_version(session: aiohttp.ClientSession, url: str, key: str) -> Optional[str]:
    """The version a server reports (the string under `key` of the JSON object at url); None when it does
    not say (no such path, another answer)."""
    try:
        async with session.get(url) as r:
            if r.status == 200:
                value = (await answer_json(r)).get(key)
                return value if isinstance(value, str) else None
    except (aiohttp.ClientError, BackendError):
        pass
    return None


@dataclass(frozen=True)
class StreamEvent:
    """What one line of a response stream says. Unknown is None."""

    content: bool = False  # carries generated output (counts for TTFT / ITL)
    text: str = ""
    done: bool = False  # the final event of the response
    prompt_tokens: Optional[int] = None
    output_tokens: Optional[int] = None
    finish_reason: Optional[str] = None
    server_timings: Optional[dict[str, float]] = None  # the server's own timings, seconds
    error: Optional[str] = None  # the stream reported an error


@dataclass
class KVCacheInfo:
    """The KV cache as the server itself reports it (None: not exposed)."""

    dtype: Optional[str] = None  # the backend's own spelling, e.g. f16, q8_0, auto, fp8
    dtype_k: Optional[str] = None
    dtype_v: Optional[str] = None
    blocks: Optional[int] = None
    block_size: Optional[int] = None
    capacity_tokens: Optional[int] = None  # cells (llama.cpp) or blocks x block_size (vLLM)
    window_tokens: Optional[int] = None  # cells the sliding-window layers keep (a windowed model; llama.cpp)
    bytes: Optional[int] = None
    gpu_memory_utilization: Optional[float] = None
    max_concurrency: Optional[float] = None  # as the server states it (vLLM's startup line)
    seqs: Optional[int] = None  # parallel sequences / slots
    rotation_k: Optional[bool] = None  # the server rotates K / V before quantising them (llama.cpp)
    rotation_v: Optional[bool] = None
    source: list[str] = field(default_factory=list)  # where each figure came from


@dataclass
class TelemetrySample:
    """One poll of the server's own metrics (None: not exposed)."""

    kv_usage: Optional[float] = None  # 0..1
    running: Optional[int] = None
    waiting: Optional[int] = None
    preemptions_total: Optional[float] = None  # a counter; levels use the difference


@dataclass
class Request:
    path: str  # e.g. /v1/completions
    body: dict[str, Any]


# A pooled connection idle this long is closed by the client: shorter than every server's own idle
# timeout (llama-server's HTTP library and vLLM's uvicorn both drop a keep-alive connection after 5 s),
# so no request ever goes out on a connection the server has already closed.
CLIENT_KEEPALIVE_S = 2.0


def connector(limit: Optional[int] = None) -> aiohttp.TCPConnector:
    """The connection pool of every client session kvexp opens to a server (limit None: no limit)."""
    return aiohttp.TCPConnector(limit=0 if limit is None else max(1, limit), limit_per_host=0,
                                keepalive_timeout=CLIENT_KEEPALIVE_S, enable_cleanup_closed=True)


PORT = "{port}"  # stands for the port in a ServerSpec's argv and environment until launch
SCRATCH = "{scratch}"  # stands for the server's scratch folder in its environment (made at launch, process.py)



def auth_headers(cfg: ExperimentConfig) -> Optional[dict[str, str]]:
    """The Authorization header, from the environment variable backend.api_key_env names (the key itself
    is never written anywhere); raises ConfigError when that variable is not set."""
    name = cfg.backend.api_key_env
    if not name:
        return None
    key = os.environ.get(name)
    if not key:
        raise ConfigError(f"backend.api_key_env={name}: that environment variable is not set")
    return {"Authorization": f"Bearer {key}"}

@dataclass(frozen=True)
class Capabilities:
    """What a backend can do or expose; the runner, the prompts and the reports read these, never the
    backend's name."""

    forces_output_length: bool  # False: output length can only be capped (Ollama)
    exact_prompts: bool  # prompts of an exact token length (the server has a tokenizer endpoint)
    exposes_kv_usage: bool  # the server reports how full its KV cache is
    exposes_preemptions: bool  # the server counts preemptions
    logprobs: bool  # the serving API returns token log-probabilities
    stream_keepalive: bool = True  # False: the server closes the connection after each streamed response
    # no tokenizer endpoint, but kvexp reads the served model's vocabulary itself before the levels
    # (Adapter.text_units): prompts are text of an exact length (Ollama serving a GGUF kvexp imports)
    offline_tokenizer: bool = False


@dataclass(frozen=True)
class ServerSpec:
    """One server as kvexp launches it, resolved once from the job's config by its adapter
    (`Adapter.resolve`). The runner launches from it and records it; the planner plans from it, so a
    prediction describes the server that was launched. argv and env hold PORT for the port."""

    backend: str
    program: Optional[str]
    model_path: Optional[str]
    argv: Optional[tuple[str, ...]]  # None: nothing to launch (attached endpoint, or program/model missing)
    env: tuple[tuple[str, str], ...]
    env_unset: tuple[str, ...]  # inherited variables dropped before env is applied
    health_path: str
    kv_dtype: str  # the portable name (kv=)
    kv_backend_dtype: str  # the backend's own spelling
    kv_bytes_per_element: float
    slots: Optional[int]  # sequences run at once (None: the server's own default, not limited)
    context_tokens: Optional[int]  # the context setting (llama.cpp -c for all slots; vLLM --max-model-len;
    #                                Ollama OLLAMA_CONTEXT_LENGTH per sequence)
    context_per_seq_tokens: Optional[int]  # the longest sequence one slot may hold (before cell padding)
    block_size: Optional[int]  # paged caches
    kv_budget_bytes: Optional[int]  # a fixed KV budget (vLLM --kv-cache-memory-bytes)
    gpu_memory_utilization: Optional[float]  # the share of GPU memory when no budget is fixed
    unified_kv: bool
    cache: CacheModel
    capabilities: Capabilities
    sources: tuple[tuple[str, str], ...] = ()  # where slots, context, block size, budget came from
    numerics: tuple[tuple[str, Any], ...] = ()  # launch settings besides the KV dtype that change the numbers
    cpus: Optional[tuple[int, ...]] = None  # the CPUs the server is pinned to (None: not pinned)
    tensor_parallel: int = 1  # GPUs that split the weights and the KV cache (vLLM --tensor-parallel-size)
    # its resident memory when it runs on the CPU (kvexp/capacity/cpumemory.py; None: it does not, or no model)
    cpu_memory: Optional[CpuMemoryModel] = None

    def launch_argv(self, port: int) -> list[str]:
        if self.argv is None:
            raise BackendError(f"{self.backend}: nothing to launch (no program or no model)")
        return [a.replace(PORT, str(port)) for a in self.argv]

    def launch_env(self, port: int) -> dict[str, str]:
        """The environment to add; a variable that names the port is left out for port 0."""
        return {k: v.replace(PORT, str(port)) for k, v in self.env if port or PORT not in v}

    def process_env(self) -> dict[str, str]:
        """The whole environment of a program run with this server's settings (e.g. llama-perplexity
        beside llama-server): kvexp's own, less env_unset, plus env (port-free variables only)."""
        return {**{k: v for k, v in os.environ.items() if k not in self.env_unset}, **self.launch_env(0)}

    @property
    def key(self) -> tuple:
        """What makes two launches the same server (the port aside)."""
        return (self.argv, self.env, self.env_unset, self.cpus)

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend, "program": self.program, "model_path": self.model_path,
            "kv_dtype": self.kv_dtype, "kv_backend_dtype": self.kv_backend_dtype,
            "kv_bytes_per_element": self.kv_bytes_per_element, "slots": self.slots,
            "context_tokens": self.context_tokens, "context_per_seq_tokens": self.context_per_seq_tokens,
            "block_size": self.block_size, "kv_budget_bytes": self.kv_budget_bytes,
            "gpu_memory_utilization": self.gpu_memory_utilization, "unified_kv": self.unified_kv,
            "cache": {"paged": self.cache.paged, "context_per_slot": self.cache.context_per_slot,
                      "cell_pad": self.cache.cell_pad},
            "capabilities": asdict(self.capabilities),
            "sources": dict(self.sources),
            "numerics": dict(self.numerics),
            "cpus": None if self.cpus is None else list(self.cpus),
            "tensor_parallel": self.tensor_parallel,
        }


class Adapter:
    """The contract every backend implements: everything the runner, planner and reports use is
    declared here, with a default where a backend may lack it. A subclass sets the class attributes,
    `locate_program`, `locate_model` and `_spec`, and the request/stream/telemetry methods.

    An adapter is built from a job's config and the program and model it serves (`create` finds them);
    its spec is resolved once, in the constructor."""

    name: ClassVar[str]
    display_name: ClassVar[str]  # how reports name it
    chart_marker: ClassVar[str] = "D"
    config_class: ClassVar[type[BackendConfig]]
    model_field: ClassVar[str]  # the ModelConfig field holding what this backend serves (gguf, hf, ...)
    kv_pairs: ClassVar[bool] = False  # takes a K type and a V type apart (kv=q8_0/q4_0)
    capabilities: ClassVar[Capabilities]
    cache_model: ClassVar[CacheModel]
    health_path: ClassVar[str] = "/health"
    # what the hang watch asks while every stream is quiet: a path the server's engine loop answers
    # itself, so an engine stuck behind live HTTP threads (that still answer health_path) counts as hung
    # (None: health_path, where the server has no such path)
    watch_path: ClassVar[Optional[str]] = None
    installable: ClassVar[bool] = False  # `python -m kvexp install <name>` builds or installs its server
    cuda_build: ClassVar[bool] = False  # and can make its CUDA build (`install <name> --cuda`)

    def __init__(self, cfg: ExperimentConfig, model_path: Optional[str], program: Optional[str]):
        check_kv(self.name, cfg.kv)
        if not isinstance(cfg.backend, self.config_class):
            raise ConfigError(f"backend={cfg.backend.name}: the config is not a {self.config_class.__name__}")
        self.cfg = cfg
        self.b = cfg.backend
        self.model_path = model_path
        self.program = program
        self.kv_type = cfg.kv.per_backend[self.name]
        self.served_name = cfg.model.name
        self.base_url = ""
        self.placement = placement.plan(cfg)
        self.spec = self._spec()

    # ---- resolving: what to launch
    @classmethod
    def locate_program(cls, cfg: ExperimentConfig) -> Optional[str]:
        """The program that launches the server; raises ConfigError saying how to get it."""
        return None

    @classmethod
    def locate_model(cls, cfg: ExperimentConfig, program: Optional[str]) -> Optional[str]:
        """What the server serves (a path, or a tag); raises ConfigError when it is missing."""
        return getattr(cfg.model, cls.model_field)

    @classmethod
    def served_field(cls, model: Any) -> str:
        """The ModelConfig field this backend serves from for `model` (model_field, unless the backend
        takes one of several: Ollama serves a tag, else imports model.gguf)."""
        return cls.model_field

    @classmethod
    def check_model(cls, cfg: ExperimentConfig) -> None:
        """Refuse (ConfigError) a model that cannot be there, without making or loading anything."""

    @classmethod
    def create(cls, cfg: ExperimentConfig, locate: bool = True) -> "Adapter":
        """The adapter for cfg. locate=False (planning only): a missing program or model is left None."""
        program = model = None
        if locate and not cfg.backend.endpoint:
            program = cls.locate_program(cfg)
        try:
            model = cls.locate_model(cfg, program) if locate else getattr(cfg.model, cls.served_field(cfg.model))
        except ConfigError:
            if locate and not cfg.backend.endpoint:
                raise
        return cls(cfg, model, program)

    @classmethod
    def resolve(cls, cfg: ExperimentConfig, locate: bool = True) -> ServerSpec:
        return cls.create(cfg, locate).spec

    @classmethod
    def install(cls, force: bool = False, build: str = "cpu") -> None:
        """Install the server once; build "cpu" or, where cuda_build, "cuda" (kvexp/assets/cuda.py chooses)."""
        raise ConfigError(f"{cls.name}: kvexp cannot install this server; install it yourself")

    def _spec(self) -> ServerSpec:
        raise NotImplementedError

    def _make_spec(self, argv: Optional[list[str]], env: dict[str, str], *, slots: Optional[int],
                   context: Optional[int], per_seq: Optional[int], sources: dict[str, str],
                   env_unset: tuple[str, ...] = (), block_size: Optional[int] = None,
                   kv_budget_bytes: Optional[int] = None, gpu_memory_utilization: Optional[float] = None,
                   unified_kv: bool = False, capabilities: Optional[Capabilities] = None,
                   tensor_parallel: int = 1) -> ServerSpec:
        """capabilities: this job's, where they differ from the class's (default)."""
        if argv is not None:
            self.check_environment(self.b)
        return ServerSpec(
            backend=self.name, program=self.program, model_path=self.model_path,
            argv=None if argv is None else tuple(argv), env=tuple(sorted(env.items())), env_unset=env_unset,
            health_path=self.health_path, kv_dtype=self.cfg.kv.name, kv_backend_dtype=self.kv_type,
            kv_bytes_per_element=kv_bytes_per_element(self.kv_type), slots=slots, context_tokens=context,
            context_per_seq_tokens=per_seq, block_size=block_size, kv_budget_bytes=kv_budget_bytes,
            gpu_memory_utilization=gpu_memory_utilization, unified_kv=unified_kv, cache=self.cache_model,
            capabilities=capabilities or self.capabilities, sources=tuple(sorted(sources.items())),
            numerics=tuple(sorted(self.numerics().items())), cpus=self.placement.server_cpus,
            tensor_parallel=tensor_parallel, cpu_memory=self.cpu_memory())

    @classmethod
    def logged_buffers(cls, log_text: str) -> Optional[ServerBuffers]:
        """The buffers the server states at start beside its mapped weights and its KV cache
        (kvexp/capacity/cpumemory.py); None: its log does not state them."""
        return None

    def cpu_memory(self) -> Optional[CpuMemoryModel]:
        """The planner's model of this server's resident memory when it runs on the CPU, as it is launched
        (kvexp/capacity/cpumemory.py); None: it does not run on the CPU, or kvexp has no model of it."""
        return None

    @classmethod
    def check_environment(cls, b: BackendConfig) -> None:
        """An inherited variable that changes a launched server's numbers without the spec knowing (and
        so without entering the config hash or any report) is refused, naming the setting to use (run
        by check_config, before anything starts, and again when a spec is resolved)."""
        for var, instead in cls.numerics_env.items():
            if not b.endpoint and var in os.environ and var not in b.env:
                raise ConfigError(f"{var}={os.environ[var]} is set in kvexp's environment: it changes "
                                  f"{cls.display_name}'s numbers without being recorded; unset it and use {instead}")
        prefix = cls.flag_env_prefix
        if prefix and not b.endpoint:  # a flag by another name, which kvexp would neither see nor record
            why = (f"{cls.display_name} reads every {prefix}* variable as a command-line flag, which kvexp neither "
                   "plans with nor records")
            given = sorted(k for k in b.env if k.startswith(prefix))
            if given:
                raise ConfigError(f"backend.env.{given[0]}: {why}; give the flag in backend.extra_args")
            inherited = sorted(k for k in os.environ if k.startswith(prefix))
            if inherited:
                raise ConfigError(f"{inherited[0]}={os.environ[inherited[0]]} is set in kvexp's environment: {why}; "
                                  "unset it and give the flag in backend.extra_args")
        for arg in b.extra_args:  # a flag kvexp sets itself: given again, the server would take one of the two
            flag = str(arg).split("=", 1)[0]
            managed = cls.managed_flag(flag)
            if managed:
                raise ConfigError(f"backend.extra_args: {flag} is set by kvexp itself (its value is measured, "
                                  f"recorded and hashed); use {cls.managed_flags[managed]}")

    @classmethod
    def managed_flag(cls, flag: str) -> Optional[str]:
        """The managed flag (a key of managed_flags) that `flag` is a spelling of, as the server's parser
        reads it, else None."""
        return flag if flag in cls.managed_flags else None

    @property
    def stream_keepalive(self) -> bool:
        return self.capabilities.stream_keepalive

    def launch_argv(self, port: int) -> list[str]:
        return self.spec.launch_argv(port)

    def launch_env(self, port: int) -> dict[str, str]:
        return self.spec.launch_env(port)

    def launch_env_unset(self) -> list[str]:
        return list(self.spec.env_unset)

    def unsupported_reason(self) -> Optional[str]:
        """Why this server cannot run the configured KV dtype here (None: no known obstacle)."""
        return None

    # ---- requests
    def request(self, prompt: Any, max_tokens: int, api: str, cache: bool = False) -> Request:
        """A streaming request: prompt is token ids, a text, or chat messages (api=chat). cache: the
        workload reuses prompts (shared prefixes, conversations), so let the server serve them from its
        prompt cache where that is a per-request choice."""
        raise NotImplementedError

    def parse_line(self, line: bytes) -> Optional[StreamEvent]:
        raise NotImplementedError

    async def chars_per_token(self, session: aiohttp.ClientSession) -> Optional[tuple[float, int, int]]:
        """For a backend without a tokenizer endpoint: how many characters of kvexp's estimated text the
        served model counts as one token, measured on the server ((ratio, characters sent, tokens counted));
        None: not measured (prompts assume prompts.CHARS_PER_TOKEN)."""
        return None

    async def text_units(self, session: aiohttp.ClientSession, api: str, seed: int,
                         log_dir: Path) -> Union[TextUnits, str, None]:
        """For a backend without a tokenizer endpoint: text units that each count as one token of the
        served model, with what the server adds to a prompt of `api` (prompts.TextUnits), made before
        the levels (a helper's log goes in log_dir); a string: why there are none here (prompts stay
        estimated text, and the result says why); None: the backend has no way at all."""
        return None

    async def tokenize(self, session: aiohttp.ClientSession, text: str) -> list[int]:
        raise NotImplementedError(f"{self.name} has no tokenizer endpoint")

    async def chat_prompt_tokens(self, session: aiohttp.ClientSession, text: Any) -> int:
        """Tokens the server will count for a chat request with this user message (or these messages)."""
        raise NotImplementedError(f"{self.name} has no tokenizer endpoint")

    async def reset_cache(self, session: aiohttp.ClientSession) -> Optional[str]:
        """Empty the server's prefix cache, so that one level cannot warm the next; says what was done
        (None: the server offers no way). Raises aiohttp.ClientError or BackendError when it fails."""
        return None

    # ---- telemetry
    async def version(self, session: aiohttp.ClientSession) -> Optional[str]:
        return None

    async def preload(self, session: aiohttp.ClientSession) -> bool:
        """Load the model before measuring, where the server loads lazily. True when it did."""
        return False

    async def loaded_models(self, session: aiohttp.ClientSession) -> Optional[list[dict[str, Any]]]:
        """The server's own accounting of loaded models (None: not exposed)."""
        return None

    async def kv_cache(self, session: aiohttp.ClientSession, log_text: str) -> KVCacheInfo:
        return KVCacheInfo()

    async def poll(self, session: aiohttp.ClientSession) -> TelemetrySample:
        """One sample of the server's gauges (called every few tens of ms by telemetry.py)."""
        return TelemetrySample()

    # ---- quality: what a KV dtype costs (kvexp/quality/measure.py)
    # how teacher-forced drift is measured: "perplexity_tool" (llama-perplexity over the same GGUF),
    # "prompt_logprobs" (the serving API's log-probabilities of given text), or None (not exposed)
    teacher_forced: ClassVar[Optional[str]] = None
    continuation_unit: ClassVar[str] = "token"  # what a greedy continuation is compared in

    def continuation_request(self, prompt: Any, max_tokens: int, top_k: int, seed: int) -> Optional[Request]:
        """One greedy, seeded, non-streamed continuation with top-k log-probabilities where the API
        gives them (None: the backend cannot)."""
        return None

    def parse_continuation(self, data: dict[str, Any]) -> tuple[list[Any], list[Optional[dict[int, float]]]]:
        """(units, top-k log-probabilities per unit; None where not exposed) of a continuation answer."""
        raise NotImplementedError(f"{self.name}: no continuation API")

    # inherited environment variables that change the server's numbers -> the setting to use instead
    numerics_env: ClassVar[dict[str, str]] = {}
    # the server's command-line flags kvexp sets (every spelling) -> the setting to use instead
    managed_flags: ClassVar[dict[str, str]] = {}
    # the prefix of the environment variables the server reads as command-line flags (None: it reads none)
    flag_env_prefix: ClassVar[Optional[str]] = None

    def numerics(self, kv_type: Optional[str] = None) -> dict[str, Any]:
        """The launch settings besides the KV dtype that change the server's numbers with KV type
        kv_type (default: the job's), recorded in the spec and used as a cache key."""
        return {}

    # the lines of the server's log kept whole whatever the log's cap, as they stream (a regular expression
    # matched within a line; None: none): what kvexp or its checks read back later (kvexp/backends/serverlog.py)
    log_kept: ClassVar[Optional[str]] = None

    def log_states_kv(self, log_text: str) -> bool:
        """Whether the server's log already holds its KV cache lines (the runner waits a moment for
        them: a server's logger may write them after it answers its health probe)."""
        return True

    def model_lost(self, log_part: str) -> Optional[str]:
        """The server's own words when the part of its log written during a level says it lost its
        model meanwhile (a model process that died and was loaded again), else None: such a level's
        figures mix two loads and a cold start."""
        return None

    def check_kv(self, info: KVCacheInfo) -> Optional[str]:
        """Why the KV cache the server reports contradicts the spec beyond its dtype (None: it does not)."""
        return None

    def unfinished_stream(self, repeats: int) -> Optional[str]:
        """Why a stream ended without its final event, where the server's own rules say (repeats: how
        many times in a row the last output token's text came again); None: the server does not say."""
        return None

    # ---- the server's own view of a level, beside the client's
    server_timing_source: ClassVar[str] = "per-request timings"

    def request_timing(self, timings: Optional[dict[str, float]],
                       output_tokens: Optional[int]) -> Optional[dict[str, Optional[float]]]:
        """One request's server-side figures as {tpot_s, prefill_s, cached_tokens} (None: not stated)."""
        return None

    async def server_counters(self, session: aiohttp.ClientSession) -> Optional[dict[str, float]]:
        """Cumulative server counters and histogram sums, read before and after a level (None: none)."""
        return None

    def cached_tokens(self, record: Any) -> Optional[float]:
        """Prompt tokens the server says it served from its cache for one successful request (None: it
        does not say)."""
        timing = self.request_timing(record.server_timings, record.output_tokens) if record.ok else None
        return None if timing is None else timing.get("cached_tokens")

    def prefix_cache(self, records: list[Any], before: Optional[dict[str, float]],
                     after: Optional[dict[str, float]]) -> Optional[dict[str, Any]]:
        """Prompt tokens the server served from its prefix cache over a level (stats.prefix_cache_view):
        here from each request's own timings (llama.cpp: cache_n); None where the server does not say."""
        from kvexp.metrics import stats  # numpy: kept off the CLI's start (--help, config checks)

        pairs = [(c, r.prompt_tokens) for r in records
                 if r.prompt_tokens is not None and (c := self.cached_tokens(r)) is not None]
        if not pairs:
            return None
        return stats.prefix_cache_view(f"{self.server_timing_source}: cached prompt tokens",
                                       queried=sum(p for _, p in pairs), hits=sum(c for c, _ in pairs))

    def server_view(self, records: list[Any], before: Optional[dict[str, float]],
                    after: Optional[dict[str, float]]) -> Optional[dict[str, Any]]:
        """What the server measured for a level's requests (stats.server_view_*); None: not exposed."""
        from kvexp.metrics import stats  # numpy: kept off the CLI's start (--help, config checks)

        timings = [t for r in records if r.ok and (t := self.request_timing(r.server_timings, r.output_tokens))]
        return stats.server_view_from_requests(timings, self.server_timing_source)
