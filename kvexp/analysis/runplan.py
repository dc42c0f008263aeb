"""The planner's view of a run, read from a document: its own planner block; else the levels'
predicted KV usage; else one derived from the document's calibration table."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from kvexp.analysis.documents import is_num
from kvexp.capacity.planner import kv_bytes_per_token
from kvexp.planning.recompute import kvexp_tokens
from kvexp.results import blocks
from kvexp.results.blocks import CalibrationRow
from kvexp.results.runs import Aggregate, Run


def num(v: Any) -> Optional[float]:
    """A number of a planner block or a calibration row (None: missing, or not a number)."""
    return float(v) if is_num(v) else None


@dataclass(frozen=True)
class PlanLevel:
    x: float
    predicted_kv_usage: Optional[float]  # 0..1
    predicts_preemption: Optional[bool]
    predicts_queueing: Optional[bool] = None


@dataclass(frozen=True)
class RunPlan:
    label: str
    source: str  # "run planner" | "levels" | "calibration table"
    kv_bytes_per_token: Optional[float]
    capacity_tokens: Optional[float]
    max_concurrency: Optional[float]  # whole requests before preemption (vLLM)
    levels: tuple[PlanLevel, ...]
    calibrated_capacity_tokens: Optional[float] = None
    calibrated_max_concurrency: Optional[float] = None
    calibrated_levels: tuple[PlanLevel, ...] = ()
    tokens_per_request: Optional[float] = None
    max_concurrent_requests: Optional[float] = None  # served at once before the rest queue
    kv_cache_bytes: Optional[float] = None  # the whole KV cache the planner predicts (a window included)
    window_bytes_per_sequence: Optional[float] = None  # a windowed model's fixed part (None: no window)


def _plan_levels(rows: list[blocks.PlanRow]) -> tuple[PlanLevel, ...]:
    out = [PlanLevel(float(row.concurrency), num(row.predicted_kv_usage),  # type: ignore[arg-type]
                     row.predicts_preemption, row.predicts_queueing) for row in rows if is_num(row.concurrency)]
    return tuple(sorted(out, key=lambda p: p.x))


def _calibration_row(run: Run, aggregate: Aggregate) -> Optional[CalibrationRow]:
    kv = run.kv_cache.dtype or run.kv_requested
    for row in aggregate.calibration or []:
        if row.model == run.model and kv and row.kv_cache_dtype == kv:
            return row
    return None


def run_plan(run: Run, aggregate: Aggregate) -> Optional[RunPlan]:
    """The planner's view of a run: its own planner block; else the levels' predicted_kv_usage; else one
    derived from the aggregate's calibration table (capacity = predicted_tokens, each request holding
    prompt + max tokens, usage capped at 100 % as the planner does)."""
    label = run.label
    p = run.planner
    if p is not None:
        cal = p.calibrated or blocks.Plan()
        return RunPlan(
            label, "run planner", num(p.kv_bytes_per_token), num(p.capacity_tokens),
            num(p.max_concurrency_before_preemption), _plan_levels(p.levels),
            num(cal.capacity_tokens), num(cal.max_concurrency_before_preemption),
            _plan_levels(cal.levels), num(p.request_tokens), num(p.max_concurrent_requests),
            num(p.kv_cache_bytes), p.window_bytes_per_sequence)
    from_levels = tuple(sorted((PlanLevel(float(lv.concurrency), float(lv.predicted_kv_usage), None)
                                for lv in run.merged_levels()
                                if is_num(lv.predicted_kv_usage) and is_num(lv.concurrency)), key=lambda p: p.x))
    if from_levels:
        return RunPlan(label, "levels", None, None, None, from_levels)
    row = _calibration_row(run, aggregate)
    prompt = float(run.prompt_tokens) if is_num(run.prompt_tokens) else None
    out_tok = float(run.max_tokens) if is_num(run.max_tokens) else None
    if row is None or not num(row.predicted_tokens) or prompt is None or out_tok is None:
        return None
    per_req = prompt + out_tok

    def levels_for(cap: Optional[float]) -> tuple[PlanLevel, ...]:
        if not cap:
            return ()
        xs = sorted({float(lv.concurrency) for lv in run.levels if is_num(lv.concurrency)})
        return tuple(PlanLevel(c, min(1.0, c * per_req / cap), c * per_req > cap) for c in xs)

    mine = kvexp_tokens(row, aggregate)
    cap, ccap = (mine if mine is not None else num(row.predicted_tokens)), num(row.calibrated_tokens)
    bpt = None
    pl = aggregate.planner or blocks.PlannerConstants()
    arch = pl.models.get(row.preset or "")
    kvb = (pl.kv_bytes or {}).get(str(row.kv_cache_dtype))
    dims = arch.dims if arch is not None else None
    if dims is not None and is_num(kvb):
        bpt = kv_bytes_per_token(*dims, kvb)
    return RunPlan(
        label, "calibration table", bpt, cap, math.floor(cap / per_req) if cap else None, levels_for(cap),
        ccap, math.floor(ccap / per_req) if ccap else None, levels_for(ccap), per_req)
