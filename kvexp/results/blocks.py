"""The blocks of a result and of an aggregate whose shape is their producer's, typed (results/doc.py's
`Block`: each is written back as it was read): the planner's prediction (`Plan`, capacity/planner.py's
plan_job and planning/prediction.py), the quality measurement (`Quality`, quality/measure.py), the SLO
search (`Search`, metrics/search.py), the workload (`Workload`, measure/traffic.py), and an aggregate's
environment, planner constants and calibration rows (`Environment`, `PlannerConstants`, `CalibrationRow`:
a job's, the reference document's, planning/calibration.py's). Fields follow schema/result.schema.json and schema/aggregate.schema.json and
the producers' docstrings; a key a block lacks is None."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Optional

from kvexp.metrics.registry import is_num
from kvexp.results.doc import Block, read_list


# ---------------------------------------------------------------------------------------------------
# The planner's prediction (result.json's and an aggregate run's `planner`)


@dataclass(slots=True, frozen=True)
class PlanRow(Block):
    """One concurrency level of a plan: the KV usage it predicts (0..1; the most it can be where lengths
    vary), whether requests are preempted or queue there, and on the CPU the server's RSS."""

    concurrency: Optional[int] = None
    predicted_kv_usage: Optional[float] = None
    predicted_kv_usage_max: Optional[float] = None
    predicts_preemption: Optional[bool] = None
    predicts_queueing: Optional[bool] = None
    predicted_rss_gib: Optional[float] = None


@dataclass(slots=True, frozen=True)
class PlanInputs(Block):
    """Every number a plan was computed from (a plan's `inputs`); block_size is the plan's own, beside
    them (a what-if's configuration carries it: planning/whatif.py)."""

    backend: Optional[str] = None
    kv_dtype: Optional[str] = None
    model: Optional[str] = None
    n_layers: Optional[int] = None
    sliding_layers: Optional[int] = None
    model_sliding_window: Optional[int] = None
    n_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    params_b: Optional[float] = None
    weights_gib: Optional[float] = None
    weight_bits: Optional[float] = None
    dtype_bytes: Optional[float] = None
    gpu_gib: Optional[float] = None
    gpu_memory_utilization: Optional[float] = None
    overhead_gib: Optional[float] = None
    calibrated_overhead_gib: Optional[float] = None
    kv_cache_memory_bytes: Optional[int] = None
    unified_kv: Optional[bool] = None
    context_tokens: Optional[int] = None
    parallel: Optional[int] = None
    prompt_tokens: Optional[int] = None
    max_tokens: Optional[int] = None
    shared_prefix_tokens: Optional[int] = None
    prefix_groups: Optional[int] = None
    prefix_shared_in_cache: Optional[bool] = None
    tensor_parallel: Optional[int] = None
    block_size: Optional[int] = None


@dataclass(slots=True, frozen=True)
class CpuMemory(Block):
    """A plan's resident memory of the server on the CPU, its parts in bytes (capacity/cpumemory.py's
    predict_rss)."""

    predicted_peak_rss_gib: Optional[float] = None
    levels_rss_gib: Optional[list[Optional[float]]] = None
    runtime_bytes: Optional[int] = None
    weights_bytes: Optional[int] = None
    buffers_bytes: Optional[int] = None
    kv_cache_bytes: Optional[int] = None
    prompt_cache_bytes: Optional[int] = None
    saved_prompts: Optional[int] = None
    request_state_bytes: Optional[int] = None
    sources: Optional[dict[str, str]] = None
    requests_done: Optional[list[int]] = None


@dataclass(slots=True, frozen=True)
class Plan(Block):
    """The planner's prediction for a job (capacity/planner.py's plan_job says what each key means), and on
    the CPU the server's RSS (`cpu_memory`, memory_measure "rss"). Its `calibrated` is a Plan of the
    capacity keys again, with the fitted overhead (`overhead_gib`)."""

    NESTED: ClassVar[Mapping[str, Callable[[Any], Any]]] = {
        "levels": read_list(PlanRow), "inputs": PlanInputs.from_json, "calibrated": lambda v: Plan.from_json(v),
        "cpu_memory": CpuMemory.from_json}

    kv_bytes_per_element: Optional[float] = None
    kv_bytes_per_token: Optional[float] = None
    kv_window_bytes_per_token: Optional[float] = None
    kv_window_bytes_per_sequence: Optional[float] = None
    sliding_window: Optional[int] = None
    capacity_tokens: Optional[int] = None
    blocks: Optional[int] = None
    block_size: Optional[int] = None
    kv_cache_bytes: Optional[float] = None
    window_tokens: Optional[int] = None
    context_per_slot_tokens: Optional[int] = None
    slots: Optional[int] = None
    predicted_peak_memory_gib: Optional[float] = None
    max_context_that_fits: Optional[int] = None
    fits: Optional[bool] = None
    request_tokens: Optional[int] = None
    request_fits: Optional[bool] = None
    max_concurrency_before_preemption: Optional[int] = None
    max_concurrent_requests: Optional[int] = None
    levels: list[PlanRow] = field(default_factory=list)
    calibrated: Optional[Plan] = None
    overhead_gib: Optional[float] = None  # (calibrated's)
    inputs: Optional[PlanInputs] = None
    sources: Optional[dict[str, str]] = None
    cpu_memory: Optional[CpuMemory] = None
    memory_measure: Optional[str] = None  # "rss" on the CPU; None: GPU memory (or planned before the CPU was)

    @property
    def window_bytes_per_sequence(self) -> Optional[float]:
        """A sliding-window model's fixed part: one sequence's window in the sliding layers, in bytes (None
        for a model without a window)."""
        w = self.kv_window_bytes_per_sequence
        windowed = is_num(self.sliding_window) and self.sliding_window
        return float(w) if windowed and is_num(w) else None  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------
# Quality (result.json's and an aggregate run's `quality`)


@dataclass(slots=True, frozen=True)
class QualityDepth(Block):
    """The teacher-forced drift at one context depth (schema's quality_depth)."""

    context: Optional[int] = None
    status: Optional[str] = None  # ok | skipped | failed
    reason: Optional[str] = None
    chunks: Optional[int] = None
    positions: Optional[int] = None
    kld_mean: Optional[float] = None
    kld_mean_err: Optional[float] = None
    kld_median: Optional[float] = None
    kld_p99: Optional[float] = None
    kld_max: Optional[float] = None
    top1_agreement: Optional[float] = None
    ppl_base: Optional[float] = None
    ppl: Optional[float] = None
    delta_ppl: Optional[float] = None
    ppl_base_f32: Optional[float] = None
    inexact_positions: Optional[int] = None
    self_kld_mean: Optional[float] = None
    self_top1_agreement: Optional[float] = None
    rerun_identical: Optional[bool] = None


@dataclass(slots=True, frozen=True)
class TeacherForced(Block):
    NESTED: ClassVar[Mapping[str, Callable[[Any], Any]]] = {"depths": read_list(QualityDepth)}

    method: Optional[str] = None
    precision: Optional[str] = None
    top_k: Optional[int] = None
    depths: list[QualityDepth] = field(default_factory=list)
    reason: Optional[str] = None  # why it was not measured


@dataclass(slots=True, frozen=True)
class Continuation(Block):
    """Greedy continuations against the baseline's."""

    prompts: Optional[int] = None
    prompt_tokens: Optional[int] = None
    max_tokens: Optional[int] = None
    unit: Optional[str] = None
    identical_share: Optional[float] = None
    first_diff_mean: Optional[float] = None
    prefix_agreement: Optional[float] = None
    kld_prefix_mean: Optional[float] = None
    top_k: Optional[int] = None
    self_identical_share: Optional[float] = None
    reason: Optional[str] = None


@dataclass(slots=True, frozen=True)
class QualityBaseline(Block):
    kv: Optional[str] = None
    backend_dtype: Optional[str] = None
    key: Optional[str] = None
    cached: Optional[bool] = None
    measured_by_this_job: Optional[list[str]] = None
    cache_dir: Optional[str] = None


@dataclass(slots=True, frozen=True)
class Determinism(Block):
    """The baseline against itself."""

    kld_mean: Optional[float] = None
    top1_agreement: Optional[float] = None
    identical_share: Optional[float] = None
    deterministic: Optional[bool] = None
    threshold_kld: Optional[float] = None
    summary: Optional[str] = None


@dataclass(slots=True, frozen=True)
class Quality(Block):
    """What the job's KV dtype costs in quality against the 16-bit baseline (quality/measure.py)."""

    NESTED: ClassVar[Mapping[str, Callable[[Any], Any]]] = {
        "baseline": QualityBaseline.from_json, "teacher_forced": TeacherForced.from_json,
        "continuation": Continuation.from_json, "determinism": Determinism.from_json}

    kv: Optional[str] = None
    backend_dtype: Optional[str] = None
    baseline: QualityBaseline = field(default_factory=QualityBaseline)
    text: Optional[dict[str, Any]] = None
    teacher_forced: TeacherForced = field(default_factory=TeacherForced)
    continuation: Continuation = field(default_factory=Continuation)
    determinism: Determinism = field(default_factory=Determinism)
    warnings: Optional[list[str]] = None
    duration_s: Optional[float] = None

    @property
    def ok_depths(self) -> list[QualityDepth]:
        """The depths measured, with a mean KLD."""
        return [d for d in self.teacher_forced.depths if d.status == "ok" and is_num(d.kld_mean)]

    @property
    def deepest(self) -> Optional[QualityDepth]:
        """The deepest depth measured (None: none was)."""
        return max((d for d in self.ok_depths if is_num(d.context)), key=lambda d: d.context or 0, default=None)


# ---------------------------------------------------------------------------------------------------
# The SLO search and the workload (result.json's and an aggregate run's `search`, `workload`)


@dataclass(slots=True, frozen=True)
class Search(Block):
    """An SLO search (metrics/search.py's result_block): its answer, brackets, why it stopped, every probe."""

    kind: Optional[str] = None  # concurrency | rate
    answer: Optional[float] = None
    last_pass: Optional[float] = None
    first_fail: Optional[float] = None
    stop_reason: Optional[str] = None
    detail: Optional[str] = None
    objectives: Optional[dict[str, Any]] = None
    grid: Optional[list[float]] = None
    probed: Optional[list[dict[str, Any]]] = None
    measure_s: Optional[float] = None


@dataclass(slots=True, frozen=True)
class Dist(Block):
    """A workload's prompt or output lengths: fixed, or drawn from a distribution."""

    kind: Optional[str] = None
    centre: Optional[int] = None
    min: Optional[int] = None
    max: Optional[int] = None
    std: Optional[float] = None
    sigma: Optional[float] = None
    bins: Optional[list[Any]] = None
    weights: Optional[list[float]] = None
    mean: Optional[float] = None

    @property
    def varies(self) -> bool:
        return (self.kind or "fixed") != "fixed"


@dataclass(slots=True, frozen=True)
class Workload(Block):
    """What a job's levels sent (measure/traffic.py's describe)."""

    NESTED: ClassVar[Mapping[str, Callable[[Any], Any]]] = {"prompt_dist": Dist.from_json,
                                                             "output_dist": Dist.from_json}

    kind: Optional[str] = None  # synthetic | prefix | conversation | dataset | trace
    prompt_dist: Dist = field(default_factory=Dist)
    output_dist: Dist = field(default_factory=Dist)
    prefix_tokens: Optional[int] = None
    prefix_groups: Optional[int] = None
    turns: Optional[int] = None
    think_time_s: Optional[float] = None
    prompt_mode: Optional[str] = None
    chars_per_token: Optional[dict[str, Any]] = None
    text_units: Optional[dict[str, Any]] = None
    estimated_because: Optional[str] = None
    server_prompt_cache: Optional[bool] = None
    dataset: Optional[dict[str, Any]] = None  # file, entries, left_out_over_prompt_tokens
    trace: Optional[dict[str, Any]] = None  # file, rows, time_scale, span_s, block_tokens


# ---------------------------------------------------------------------------------------------------
# An aggregate's environment, planner constants and calibration rows (the reference document's shape)


@dataclass(slots=True, frozen=True)
class Environment(Block):
    """Where the runs happened (an aggregate's `environment`: a job's, results/store.py's environment and
    what the runner added to it)."""

    kvexp_version: Optional[str] = None
    hostname: Optional[str] = None
    platform: Optional[str] = None
    python: Optional[str] = None
    cpu: Optional[str] = None
    cpu_count: Optional[int] = None
    aiohttp: Optional[str] = None
    argv: Optional[list[str]] = None
    scheduler: Optional[dict[str, Any]] = None
    event_loop: Optional[str] = None
    placement: Optional[dict[str, Any]] = None
    client: Optional[dict[str, Any]] = None


@dataclass(slots=True, frozen=True)
class Preset(Block):
    """A model preset's architecture (an aggregate planner's `models`)."""

    n_layers: Optional[int] = None
    n_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    params_b: Optional[float] = None

    @property
    def dims(self) -> Optional[tuple[int, int, int]]:
        """(layers, KV heads, head size), None unless all three are numbers."""
        d = (self.n_layers, self.n_kv_heads, self.head_dim)
        return d if all(is_num(x) for x in d) else None  # type: ignore[return-value]


def _presets(v: Any) -> dict[str, Preset]:
    return {str(k): Preset.from_json(m) for k, m in v.items() if isinstance(m, Mapping)} if isinstance(v, Mapping) \
        else {}


@dataclass(slots=True, frozen=True)
class PlannerConstants(Block):
    """An aggregate's `planner`: the constants its predictions used and its model presets
    (capacity/planner.py's reference_planner_block)."""

    NESTED: ClassVar[Mapping[str, Callable[[Any], Any]]] = {"models": _presets}

    gib: Optional[int] = None
    kv_bytes: Optional[dict[str, float]] = None  # bytes per element by KV dtype
    gpu_memory_utilization: Optional[float] = None
    overhead_gib: Optional[float] = None
    block_size: Optional[int] = None
    models: dict[str, Preset] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class CalibrationRow(Block):
    """One row of an aggregate's `calibration`: a vLLM job's predicted KV capacity against the one the
    engine reported (planning/calibration.py's calibration_row; a report's rows add the calibrated ones)."""

    model: Optional[str] = None
    preset: Optional[str] = None
    backend: Optional[str] = None
    kv_cache_dtype: Optional[str] = None
    gpu_gib: Optional[float] = None
    weights_gib: Optional[float] = None
    gpu_memory_utilization: Optional[float] = None
    predicted_tokens: Optional[int] = None
    actual_tokens: Optional[int] = None
    error_pct: Optional[float] = None
    calibrated_tokens: Optional[int] = None
    calibrated_error_pct: Optional[float] = None
