"""A run as analysis and reports see it, and the aggregate of runs (schema/aggregate.schema.json).

One `Run` type for every source: a kvexp job (`Run.of_job`, from its result.json), a run of an aggregate
file (`Run.from_json`: kvexp's sweep.json and comparison.json, the reference document) and another tool's
file (results/foreign.py builds it). What a run is lives here, once: its KV dtype as a name (`kv`), how
sentences name it (`kind`), its weights (`weights_text`), which figures it exposes (`exposes`), its levels
with repeats merged (`merged_levels`), its latency objectives (`objectives`) and its KV bytes per token."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar, Mapping, Optional

from kvexp import backends
from kvexp.metrics.levels import Level
from kvexp.metrics.registry import is_num
from kvexp.results.blocks import CalibrationRow, Environment, Plan, PlannerConstants, Quality, Search, Workload
from kvexp.results.doc import Doc, read_levels, read_list
from kvexp.results.documents import JobResult, KVCache

_LABEL_KV = re.compile(r"(?:^|[-_.])(fp32|f32|fp16|f16|bf16|fp8|q8_0|q8|q5_1|q5_0|q4_1|q4_0|q4)[-_]?kv(?:$|[-_.])",
                       re.IGNORECASE)


@dataclass(frozen=True)
class KVName:
    """A run's KV dtype as reports name it, where the name came from, and what the server did to the values."""

    name: Optional[str]
    source: Optional[str]  # "requested" | "server" | "label" | None
    note: Optional[str] = None  # KV numerics beside the dtype: "rotated", "not rotated", "scale 1.0"

    @property
    def display(self) -> str:
        if self.name is None:
            return "—"
        name = f"{self.name}†" if self.source == "label" else self.name
        return f"{name} ({self.note})" if self.note else name


@dataclass(slots=True, frozen=True)
class Weights(Doc):
    """The weights a run's server ran (result.json's model fields; an aggregate run's `weights`)."""

    weights_format: Optional[str] = None
    bits_per_weight: Optional[float] = None
    params_b: Optional[float] = None
    origin: Optional[str] = None
    present: Optional[frozenset[str]] = field(default=None, repr=False, compare=False)

    @property
    def display(self) -> str:
        """As a table shows them: "GGUF Q4_1, 5.74 bits/weight", "bfloat16", "—" when unknown."""
        fmt, bits = self.weights_format, self.bits_per_weight
        if fmt and bits and fmt.startswith("GGUF"):
            return f"{fmt}, {bits:.2f} bits/weight"
        return str(fmt) if fmt else "—"


@dataclass(slots=True, frozen=True)
class SLO(Doc):
    """A job's latency objectives (p95 unless the job chose another percentile)."""

    slo_ttft_ms: Optional[float] = None
    slo_tpot_ms: Optional[float] = None
    percentile: str = "p95"
    present: Optional[frozenset[str]] = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, d: Any) -> Optional["SLO"]:
        """The objectives a JSON object sets (a config's scenario, a search's objectives, a run's slo);
        None when it sets neither latency."""
        if not isinstance(d, Mapping) or (d.get("slo_ttft_ms") is None and d.get("slo_tpot_ms") is None):
            return None
        return cls(d.get("slo_ttft_ms"), d.get("slo_tpot_ms"), d.get("percentile") or d.get("slo_percentile") or "p95")

    def to_json(self) -> dict[str, Any]:
        return {"slo_ttft_ms": self.slo_ttft_ms, "slo_tpot_ms": self.slo_tpot_ms, "percentile": self.percentile}


@dataclass(slots=True, frozen=True)
class Placement(Doc):
    """Where the server and the client ran on the machine's CPUs (result.json's environment.placement)."""

    mode: Optional[str] = None
    server_cpus: Optional[list[int]] = None
    client_cpus: Optional[list[int]] = None
    server_cpus_seen: Optional[list[int]] = None
    server_processes: Optional[list[dict[str, Any]]] = None  # each process of the server: pid, name, threads, CPUs
    reason: Optional[str] = None
    present: Optional[frozenset[str]] = field(default=None, repr=False, compare=False)

    @property
    def key(self) -> Optional[tuple[str, tuple[int, ...]]]:
        """(mode, the CPUs the server had: those its process tree was read back on, else those it was pinned
        to); None when the mode is not recorded."""
        if not self.mode:
            return None
        cpus = self.server_cpus_seen or self.server_cpus or []
        return str(self.mode), tuple(sorted(int(c) for c in cpus)) if isinstance(cpus, list) else ()


@dataclass(slots=True)
class Run(Doc):
    """One run of an aggregate: a job of kvexp's, or another tool's levels (tool set). Its planner, quality,
    search and workload are results/blocks.py's; its numerics stay a JSON object (the launch's settings)."""

    NESTED: ClassVar[Mapping[str, Callable[[Any], Any]]] = {
        "kv_cache": KVCache.from_json, "levels": read_levels, "weights": Weights.from_json, "slo": SLO.of,
        "placement": Placement.from_json, "planner": Plan.from_json, "quality": Quality.from_json,
        "workload": Workload.from_json, "search": Search.from_json}
    NOT_NULL: ClassVar[tuple[str, ...]] = ("status", "variable_length", "reused_server", "tool_notes", "not_recorded")

    label: str = ""
    backend: Optional[str] = None  # the backend's name ("llamacpp"; "unknown" for another tool's run)
    model: Optional[str] = None  # the file served (its path), else the model's name
    scenario: Optional[str] = None
    prompt_tokens: Optional[int] = None
    max_tokens: Optional[int] = None
    started_at: Optional[str] = None  # "2025-01-31 12:00 UTC"
    gpu: Optional[str] = None
    gpu_gib: Optional[float] = None
    kv_cache: KVCache = field(default_factory=KVCache)
    levels: list[Level] = field(default_factory=list)
    status: Optional[str] = None  # complete | partial | failed | skipped (None: not recorded; see state)
    status_reason: Optional[str] = None
    backend_version: Optional[str] = None
    launch_command: Optional[list[str]] = None
    variable_length: Optional[bool] = None
    kv_requested: Optional[str] = None
    weights: Optional[Weights] = None
    numerics: Optional[dict[str, Any]] = None
    placement: Optional[Placement] = None
    reused_server: Optional[bool] = None
    planner: Optional[Plan] = None
    quality: Optional[Quality] = None
    workload: Optional[Workload] = None
    source: Optional[str] = None
    search: Optional[Search] = None
    slo: Optional[SLO] = None
    tool: Optional[str] = None  # the benchmark tool that measured it, when not kvexp
    tool_version: Optional[str] = None
    tool_notes: Optional[list[str]] = None
    not_recorded: Optional[list[str]] = None
    present: Optional[frozenset[str]] = field(default=None, repr=False, compare=False)

    @classmethod
    def of_job(cls, job: JobResult, source: Optional[str] = None) -> "Run":
        """A job result as one run of the aggregate shape."""
        started = job.started_at or ""
        m = job.model
        placement = job.placement
        return cls(
            label=str(job.label), backend=job.backend.name, model=m.path or m.name, scenario=job.scenario.name,
            prompt_tokens=job.scenario.prompt_tokens, max_tokens=job.scenario.max_tokens,
            started_at=started.replace("T", " ")[:16] + " UTC" if started else None,
            gpu=job.gpu.name, gpu_gib=job.gpu.memory_gib, kv_cache=job.kv_cache.with_required(), levels=job.levels,
            status=job.status, status_reason=job.status_reason, backend_version=job.backend.version,
            launch_command=job.backend.launch_command, variable_length=job.scenario.variable_length,
            kv_requested=job.kv.requested,
            weights=Weights(m.weights_format, m.bits_per_weight, m.params_b, m.origin),
            numerics=job.numerics, placement=None if placement is None else Placement.from_json(placement),
            reused_server=job.backend.reused_server, planner=job.planner, quality=job.quality, workload=job.workload,
            source=source, search=job.search, slo=SLO.of(job.scenario_config))

    # ------------------------------------------------------------------------------- what the run is
    @property
    def state(self) -> str:
        """Its status; "complete" where the document records none (the reference document's runs)."""
        return str(self.status or "complete")

    @property
    def foreign(self) -> bool:
        """Measured by another benchmark tool, read from its file."""
        return bool(self.tool)

    @property
    def backend_name(self) -> str:
        """The backend as people write it ("llama.cpp", "vLLM"; "unknown" for another tool's run)."""
        return backends.display_name(self.backend)

    @property
    def kv(self) -> KVName:
        """Its KV dtype: as requested, else as the server reported it, else read from the label; with its
        numerics note (what the server did to the values besides their dtype)."""
        kv = self._kv()
        return replace(kv, note=self._kv_note(kv.name)) if kv.name else kv

    def _kv(self) -> KVName:
        if self.kv_requested:
            return KVName(str(self.kv_requested), "requested")
        kv = self.kv_cache
        if kv.dtype:
            return KVName(str(kv.dtype), "server")
        if kv.dtype_k:
            k, v = kv.dtype_k, kv.dtype_v
            return KVName(str(k) if not v or v == k else f"{k}/{v}", "server")
        m = _LABEL_KV.search(self.label or "")
        if m:
            return KVName(m.group(1).lower(), "label")
        return KVName(None, None)

    def _kv_note(self, name: Optional[str]) -> Optional[str]:
        """llama.cpp's rotation of a quantised cache (as its log states it), vLLM's fp8 scales (as launched)."""
        rotation = [self.kv_cache.rotation_k, self.kv_cache.rotation_v]
        if any(rotation):
            return "rotated" if all(rotation) else f"{'K' if rotation[0] else 'V'} rotated"
        if rotation != [None, None] and str(name or "").startswith(("q", "iq")):
            return "not rotated"
        scales = str((self.numerics or {}).get("kv_scales") or "")
        return ("scales computed" if scales.startswith("computed") else "scale 1.0") if scales else None

    @property
    def kind(self) -> str:
        """"vLLM, fp8 KV": how sentences name the run's configuration."""
        kv = self.kv
        return f"{self.backend_name}, {kv.name} KV" if kv.name else self.backend_name

    @property
    def weights_text(self) -> str:
        """The weights its server ran, as a table shows them ("—": unknown)."""
        return self.weights.display if self.weights is not None else "—"

    @property
    def model_file(self) -> str:
        return str(self.model).rsplit("/", 1)[-1]

    @property
    def caps_output_only(self) -> bool:
        """The run's backend can only cap output length (read where a run does not record variable_length)."""
        adapter = backends.find(self.backend)
        return adapter is not None and not adapter.capabilities.forces_output_length

    @property
    def kv_confirmed(self) -> bool:
        """The KV dtype is known to be what ran: nothing was asked, the server confirmed it, or another
        tool's file (which records no KV dtype) measured it."""
        return bool(self.tool or not self.kv_requested or self.kv_cache.confirmed)

    @property
    def objectives(self) -> Optional[SLO]:
        """Its latency objectives: its SLO search's, else its own (None: it set none)."""
        searched = self.search.objectives if self.search is not None else None
        return SLO.of(searched) if isinstance(searched, Mapping) and searched else self.slo

    @property
    def bytes_per_token(self) -> Optional[float]:
        """KV bytes per token, one figure everywhere it is printed: the planner's (the model's layers, KV
        heads and head size at the KV dtype's bytes per element), else the server's KV bytes over its token
        capacity (a paged pool's padding makes that a few bytes more)."""
        planned = self.planner.kv_bytes_per_token if self.planner is not None else None
        if is_num(planned) and planned > 0:  # type: ignore[operator]
            return float(planned)  # type: ignore[arg-type]
        b, t = self.kv_cache.bytes, self.kv_cache.capacity_tokens
        return float(b) / float(t) if is_num(b) and is_num(t) and t > 0 else None  # type: ignore[arg-type,operator]

    # ------------------------------------------------------------------------------- its levels
    def usable(self, level: Level) -> bool:
        """Whether a level of this run may be compared: the run ran and the level did not fail."""
        return self.state not in ("failed", "skipped") and not level.failed

    def exposes(self, key: str) -> bool:
        """Whether any level carries `key` (KV usage and preemptions are often not exposed)."""
        return any(is_num(lv.value(key)) for lv in self.levels)

    def merged_levels(self) -> list[Level]:
        """The levels by concurrency (or rate), the repeats of one level merged into one (Level.merge).
        Findings and charts read these; tables show the levels as recorded."""
        groups: dict[tuple[str, float], list[Level]] = {}
        loose: list[Level] = []
        for lv in self.levels:
            x = lv.x
            (groups.setdefault(x, []) if x else loose).append(lv)
        merged = [Level.merge(g) for g in groups.values()] + loose
        return sorted(merged, key=lambda lv: lv.x or ("~", float("inf")))

    def level_at(self, x: Optional[tuple[str, float]]) -> Optional[Level]:
        """The merged level at x (None: the run has none there)."""
        return next((lv for lv in self.merged_levels() if lv.x == x), None) if x else None


@dataclass(slots=True)
class Aggregate(Doc):
    """Many runs in one document (schema/aggregate.schema.json): kvexp's sweep.json and comparison.json, and
    the reference document. The recommendations, verdicts and KV cards are analysis's, as written."""

    NESTED: ClassVar[Mapping[str, Callable[[Any], Any]]] = {
        "runs": read_list(Run), "calibration": read_list(CalibrationRow), "planner": PlannerConstants.from_json,
        "environment": Environment.from_json}
    NOT_NULL: ClassVar[tuple[str, ...]] = ("schema_version", "kind", "kvexp_version", "run_dates", "calibration",
                                           "recommendations", "verdicts", "kv_cards")

    schema_version: Optional[int] = None
    kind: Optional[str] = None
    kvexp_version: Optional[str] = None
    title: Optional[str] = None
    environment: Optional[Environment] = None
    gpu: Optional[str] = None
    gpu_gib: Optional[float] = None
    run_dates: Optional[list[str]] = None
    runs: list[Run] = field(default_factory=list)
    calibration: Optional[list[CalibrationRow]] = None
    planner: Optional[PlannerConstants] = None
    recommendations: Optional[list[dict[str, Any]]] = None
    verdicts: Optional[list[dict[str, Any]]] = None
    kv_cards: Optional[list[dict[str, Any]]] = None
    present: Optional[frozenset[str]] = field(default=None, repr=False, compare=False)

    def scenarios(self) -> list[tuple[str, list[Run]]]:
        """Runs grouped by scenario name, in order of first appearance."""
        groups: dict[str, list[Run]] = {}
        for run in self.runs:
            groups.setdefault(str(run.scenario or "unnamed"), []).append(run)
        return list(groups.items())
