"""The file boundary of kvexp's documents: a class per shape, read from JSON (`from_json`) and written back
(`to_json`) here, read by attribute everywhere above results/. The JSON Schemas in schema/ stay the contract
for the files; these classes are what the code holds.

A document read from a file writes back the keys it was read with (`present`) and those set since by
`update`, so that an old file, or another tool's level, goes into an aggregate as it was; one built in
code writes every field, null where unknown, but for the fields its schema does not let be null
(NOT_NULL), which it leaves out while unknown.
A field a document lacks is None: unknown, never 0.

This module holds the shared machinery and a job's result (result.json, `JobResult`); results/runs.py
holds a run as analysis and reports see it and the aggregate of runs."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar, Mapping, Optional

from kvexp.metrics.levels import Level
from kvexp.metrics.registry import is_num

_NAMES: dict[type, tuple[str, ...]] = {}


def _names(cls: type) -> tuple[str, ...]:
    names = _NAMES.get(cls)
    if names is None:
        names = _NAMES[cls] = tuple(f.name for f in fields(cls) if f.name != "present")
    return names


def _out(v: Any) -> Any:
    if hasattr(v, "to_json"):
        return v.to_json()
    if isinstance(v, (list, tuple)):
        return [_out(x) for x in v]
    return v


class Doc:
    """What every document class shares: `from_json` (a JSON object in, its known keys read, nested blocks
    made typed by NESTED) and `to_json` (the keys it was read with and those `update` set, or, built in
    code, every field but the NOT_NULL ones that are unknown). Subclasses are dataclasses whose every field has a default and whose
    last field is `present`."""

    __slots__ = ()
    NESTED: ClassVar[Mapping[str, Callable[[Any], Any]]] = {}
    NOT_NULL: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_json(cls, d: Any) -> Any:
        if not isinstance(d, Mapping):
            d = {}
        names = _names(cls)
        kw: dict[str, Any] = {}
        for n in names:
            if n in d:
                v, conv = d[n], cls.NESTED.get(n)
                kw[n] = conv(v) if conv is not None and v is not None else v
        return cls(**kw, present=frozenset(k for k in d if k in names))  # type: ignore[call-arg]

    def update(self, **values: Any) -> None:
        """Set fields, which to_json then writes (a document read from a file writes the keys it was read
        with and these)."""
        for n, v in values.items():
            setattr(self, n, v)
        present: Optional[frozenset[str]] = getattr(self, "present")
        if present is not None:
            setattr(self, "present", present | frozenset(values))

    def own(self) -> Any:
        """The document made the code's own, as if built here: from now on it writes every field (null where
        unknown), and so do its blocks and levels (a resumed job's result, which the runner goes on
        filling). Returns the document."""
        setattr(self, "present", None)
        for n in _names(type(self)):
            v = getattr(self, n)
            for x in v if isinstance(v, list) else [v]:
                if isinstance(x, Doc):
                    x.own()
                elif isinstance(x, Level):
                    x.present = None
        return self

    def to_json(self) -> dict[str, Any]:
        present: Optional[frozenset[str]] = getattr(self, "present")
        out = {}
        for n in _names(type(self)):
            v = getattr(self, n)
            if (n in present) if present is not None else (v is not None or n not in self.NOT_NULL):
                out[n] = _out(v)
        return out


def read_levels(v: Any) -> list[Level]:
    """A document's levels, typed (an entry that is not an object is not a level and is left out)."""
    return [Level.from_json(x) for x in v if isinstance(x, Mapping)] if isinstance(v, list) else []


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
class JobResult(Doc):
    """One job's result.json (schema/result.schema.json, kind "kvexp.job"), typed. Blocks whose shape is
    their producer's (the server spec, the config, the planner's prediction, quality, the SLO search, the
    workload) stay JSON objects, read by the modules that made them."""

    NESTED: ClassVar[Mapping[str, Callable[[Any], Any]]] = {
        "backend": BackendInfo.from_json, "model": ModelInfo.from_json, "kv": KVAsked.from_json,
        "kv_cache": KVCache.from_json, "scenario": ScenarioInfo.from_json, "gpu": GPUInfo.from_json,
        "levels": read_levels}
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
    planner: Optional[dict[str, Any]] = None
    search: Optional[dict[str, Any]] = None
    timing: Optional[dict[str, Optional[float]]] = None
    requests_file: Optional[str] = None
    quality: Optional[dict[str, Any]] = None
    levels: list[Level] = field(default_factory=list)
    workload: Optional[dict[str, Any]] = None
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
