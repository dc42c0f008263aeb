"""A job's result (result.json, `JobResult`) and its blocks, typed: read from JSON (`from_json`) and written
back (`to_json`) here, read by attribute everywhere above results/. The JSON Schemas in schema/ stay the
contract for the files; these classes are what the code holds.

results/doc.py holds the machinery every document shares (what is read is written back as it was);
results/blocks.py the blocks whose shape is their producer's; results/runs.py a run as analysis and
reports see it and the aggregate of runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Optional

from kvexp.metrics.levels import Level
from kvexp.metrics.registry import is_num
from kvexp.results.blocks import Plan, Quality, Search, Workload
from kvexp.results.doc import Doc, _names, read_levels


def _dict(v: Any) -> Optional[dict[str, Any]]:
    return v if isinstance(v, dict) else None


@dataclass(slots=True)
class KVCache(Doc):
    """The KV cache as the server reported it (result.json's and an aggregate run's `kv_cache`)."""

    REQUIRED: ClassVar[tuple[str, ...]] = ("dtype", "blocks", "block_size", "gpu_memory_utilization")
    NOT_NULL: ClassVar[tuple[str, ...]] = ("source",)

    dtype: Optional[str] = None
    blocks: Optional[int] = None
    block_size: Optional[int] = None
    gpu_memory_utilization: Optional[float] = None
    dtype_k: Optional[str] = None
    dtype_v: Optional[str] = None
    capacity_tokens: Optional[int] = None
    window_tokens: Optional[int] = None
    bytes: Optional[int] = None
    max_concurrency: Optional[float] = None
    seqs: Optional[int] = None
    source: Optional[list[str]] = None
    rotation_k: Optional[bool] = None
    rotation_v: Optional[bool] = None
    present: Optional[frozenset[str]] = field(default=None, repr=False, compare=False)

    @property
    def confirmed(self) -> bool:
        """Whether the server said which dtype its cache holds."""
        return bool(self.dtype or self.dtype_k)

    @property
    def capacity(self) -> Optional[float]:
        """The KV tokens the server reported: its capacity, else blocks x block size; None when unknown."""
        if is_num(self.capacity_tokens):
            return float(self.capacity_tokens)  # type: ignore[arg-type]
        if is_num(self.blocks) and is_num(self.block_size):
            return float(self.blocks * self.block_size)  # type: ignore[operator]
        return None

    def with_required(self) -> "KVCache":
        """The same cache, its REQUIRED keys written (null where unknown) as an aggregate run needs them."""
        if self.present is None:
            return self
        return KVCache(**{n: getattr(self, n) for n in _names(KVCache)},
                       present=self.present | frozenset(self.REQUIRED))


@dataclass(slots=True)
class BackendInfo(Doc):
    """result.json's `backend`: which server ran, its version and launch, and whether kvexp reused it."""

    name: Optional[str] = None
    version: Optional[str] = None
    launch_command: Optional[list[str]] = None
    env: Optional[dict[str, str]] = None
    endpoint: Optional[str] = None
    reused_server: Optional[bool] = None
    ready_s: Optional[float] = None
    server_log: Optional[str] = None
    server_log_bytes: Optional[dict[str, Any]] = None  # written, kept on disk, dropped under log.max_mb, the cap
    server_lines_log: Optional[str] = None
    server_lines_log_bytes: Optional[dict[str, Any]] = None
    log_tail: Optional[str] = None
    loaded_models: Optional[list[dict[str, Any]]] = None
    present: Optional[frozenset[str]] = field(default=None, repr=False, compare=False)


@dataclass(slots=True)
class ModelInfo(Doc):
    """result.json's `model`: its name, the file served and the weights it holds."""

    name: Optional[str] = None
    path: Optional[str] = None
    weights_format: Optional[str] = None
    bits_per_weight: Optional[float] = None
    params_b: Optional[float] = None
    origin: Optional[str] = None
    architecture: Optional[dict[str, Any]] = None
    present: Optional[frozenset[str]] = field(default=None, repr=False, compare=False)


@dataclass(slots=True)
class KVAsked(Doc):
    """result.json's `kv`: the KV dtype asked for, in kvexp's and the backend's spelling."""

    requested: Optional[str] = None
    backend_dtype: Optional[str] = None
    bytes_per_element: Optional[float] = None
    present: Optional[frozenset[str]] = field(default=None, repr=False, compare=False)


@dataclass(slots=True)
class ScenarioInfo(Doc):
    """result.json's `scenario`: what each request asked."""

    name: Optional[str] = None
    prompt_tokens: Optional[int] = None
    max_tokens: Optional[int] = None
    mode: Optional[str] = None
    variable_length: Optional[bool] = None
    api: Optional[str] = None
    present: Optional[frozenset[str]] = field(default=None, repr=False, compare=False)


@dataclass(slots=True)
class GPUInfo(Doc):
    name: Optional[str] = None
    memory_gib: Optional[float] = None
    driver: Optional[str] = None
    present: Optional[frozenset[str]] = field(default=None, repr=False, compare=False)


@dataclass(slots=True)
class Timing(Doc):
    """result.json's `timing`: where the job's time went, in seconds, each left out until the runner sets it."""

    NOT_NULL: ClassVar[tuple[str, ...]] = ("server_start_s", "model_load_s", "warmup_s", "measure_s", "total_s")

    server_start_s: Optional[float] = None  # 0.0: a server an earlier job left running
    model_load_s: Optional[float] = None  # a lazily loading server's (Ollama) first load
    warmup_s: Optional[float] = None
    measure_s: Optional[float] = None
    total_s: Optional[float] = None
    present: Optional[frozenset[str]] = field(default=None, repr=False, compare=False)


@dataclass(slots=True)
class JobResult(Doc):
    """One job's result.json (schema/result.schema.json, kind "kvexp.job"), typed. The planner's prediction,
    quality, the SLO search and the workload are results/blocks.py's, written back as they were read; the
    server spec, the environment and the config stay JSON objects, the runner's."""

    NESTED: ClassVar[Mapping[str, Callable[[Any], Any]]] = {
        "backend": BackendInfo.from_json, "model": ModelInfo.from_json, "kv": KVAsked.from_json,
        "kv_cache": KVCache.from_json, "scenario": ScenarioInfo.from_json, "gpu": GPUInfo.from_json,
        "levels": read_levels, "planner": Plan.from_json, "search": Search.from_json, "quality": Quality.from_json,
        "workload": Workload.from_json, "timing": Timing.from_json}
    NOT_NULL: ClassVar[tuple[str, ...]] = ("resumed_at", "timing")

    schema_version: Optional[int] = None
    kind: Optional[str] = None
    kvexp_version: Optional[str] = None
    label: Optional[str] = None
    status: Optional[str] = None
    status_reason: Optional[str] = None
    started_at: Optional[str] = None
    finished_at: Optional[str] = None
    resumed_at: Optional[list[str]] = None
    backend: BackendInfo = field(default_factory=BackendInfo)
    model: ModelInfo = field(default_factory=ModelInfo)
    kv: KVAsked = field(default_factory=KVAsked)
    server: Optional[dict[str, Any]] = None
    kv_cache: KVCache = field(default_factory=KVCache)
    scenario: ScenarioInfo = field(default_factory=ScenarioInfo)
    gpu: GPUInfo = field(default_factory=GPUInfo)
    environment: Optional[dict[str, Any]] = None
    config: Optional[dict[str, Any]] = None
    config_hash: Optional[str] = None
    planner: Optional[Plan] = None
    search: Optional[Search] = None
    timing: Optional[Timing] = None
    requests_file: Optional[str] = None
    quality: Optional[Quality] = None
    levels: list[Level] = field(default_factory=list)
    workload: Optional[Workload] = None
    present: Optional[frozenset[str]] = field(default=None, repr=False, compare=False)

    @property
    def numerics(self) -> Optional[dict[str, Any]]:
        """The launch settings besides the KV dtype that change the server's numbers (server.numerics)."""
        return _dict((self.server or {}).get("numerics"))

    @property
    def placement(self) -> Optional[dict[str, Any]]:
        return _dict((self.environment or {}).get("placement"))

    @property
    def scenario_config(self) -> dict[str, Any]:
        """The job's scenario as configured (config.scenario; {} when the result does not hold it)."""
        return _dict((self.config or {}).get("scenario")) or {}
