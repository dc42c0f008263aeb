"""Foreign documents are recomputed, not echoed: a results document that carries its own planner
inputs (the reference document's `planner` block and `calibration` rows: preset, KV dtype, GPU GiB,
weights, memory utilisation) gets its predictions computed again by kvexp's own planner
(planner.plan_job, over the cache model of the backend that served the rows' runs), and the
document's own figures are checked against kvexp's.

A row's backend is its own `backend` field, else the backend of the document's runs with the same
model and KV dtype; its architecture is the document's preset (`planner.models`), else kvexp's preset
of that name; the overhead and block size are the document's planner constants, else kvexp's
defaults. Pure: no file is read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from kvexp.backends import find
from kvexp.capacity import planner
from kvexp.capacity.planner import CacheModel, ModelArch
from kvexp.results.blocks import CalibrationRow, PlanInputs, PlannerConstants
from kvexp.results.runs import Aggregate


@dataclass(frozen=True)
class Check:
    """One calibration row of a document, recomputed. kvexp_tokens None: kvexp could not recompute it
    (`reason` says why); agrees None then, else whether the document's predicted_tokens equals it."""

    index: int
    model: Optional[str]
    preset: Optional[str]
    backend: Optional[str]
    kv_dtype: Optional[str]
    gpu_gib: Optional[float]
    document_tokens: Optional[int]
    kvexp_tokens: Optional[int]
    actual_tokens: Optional[int]
    agrees: Optional[bool]
    reason: Optional[str] = None
    inputs: PlanInputs = field(default_factory=PlanInputs)  # planner inputs, for a what-if

    @property
    def kvexp_error_pct(self) -> Optional[float]:
        """kvexp's prediction vs the engine's capacity, in percent."""
        if self.kvexp_tokens is None or not self.actual_tokens:
            return None
        return round((self.kvexp_tokens - self.actual_tokens) / self.actual_tokens * 100, 1)

    @property
    def sentence(self) -> str:
        what = f"{self.preset or self.model} {self.kv_dtype}" + (f" on {self.gpu_gib:g} GiB" if self.gpu_gib else "")
        if self.kvexp_tokens is None:
            return f"The document's prediction for {what} could not be recomputed: {self.reason}."
        if self.agrees:
            return f"kvexp's planner reproduces the document's prediction for {what}: {self.kvexp_tokens:,} tokens."
        if self.document_tokens is None:
            return f"The document gives no prediction for {what}; kvexp's planner computes {self.kvexp_tokens:,} tokens."
        diff = (self.document_tokens - self.kvexp_tokens) / self.kvexp_tokens * 100 if self.kvexp_tokens else None
        tail = "" if diff is None else f" ({diff:+.1f} %)"
        return (f"The document's predicted capacity for {what} ({self.document_tokens:,} tokens) disagrees with "
                f"kvexp's planner on the same inputs ({self.kvexp_tokens:,} tokens){tail}; the report uses kvexp's.")


def _num(x: Any) -> Optional[float]:
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def row_backend(row: CalibrationRow, aggregate: Aggregate) -> Optional[str]:
    """The backend a calibration row describes: its own field, else its runs' (same model, KV dtype)."""
    if row.backend:
        return str(row.backend)
    for run in aggregate.runs:
        if str(run.model) == str(row.model) and run.kv_cache.dtype == row.kv_cache_dtype and run.backend:
            return str(run.backend)
    return None


def _arch(row: CalibrationRow, pl: PlannerConstants) -> tuple[Optional[ModelArch], Optional[str]]:
    preset = row.preset
    m = pl.models.get(preset) if preset else None
    dims = m.dims if m is not None else None
    if m is not None and dims is not None:
        return ModelArch(int(dims[0]), int(dims[1]), dims[2], _num(m.params_b), _num(row.weights_gib), name=preset,
                         sources={"n_layers": "document's preset"}), None
    if preset in planner.PRESETS:
        return ModelArch.from_preset(preset, _num(row.weights_gib)), None
    return None, f"preset {preset!r} is neither in the document's planner block nor one of kvexp's"


def check_row(index: int, row: CalibrationRow, aggregate: Aggregate,
              cache_for: Any = None) -> Check:
    """Recompute one calibration row. cache_for: backend name -> CacheModel or None (default: the
    adapter registry's declared cache models)."""
    if cache_for is None:
        def cache_for(name: Optional[str]) -> Optional[CacheModel]:
            a = find(name)
            return a.cache_model if a is not None else None

    pl = aggregate.planner or PlannerConstants()
    backend = row_backend(row, aggregate)
    kv = row.kv_cache_dtype
    doc, actual = _num(row.predicted_tokens), _num(row.actual_tokens)
    base = dict(index=index, model=row.model, preset=row.preset, backend=backend, kv_dtype=kv,
                gpu_gib=_num(row.gpu_gib), document_tokens=None if doc is None else int(doc),
                actual_tokens=None if actual is None else int(actual))

    def fail(reason: str) -> Check:
        return Check(**base, kvexp_tokens=None, agrees=None, reason=reason)

    cache = cache_for(backend)
    if cache is None:
        return fail(f"no run of this model and KV dtype names a backend kvexp knows ({backend or 'none'})")
    if not cache.paged:
        return fail(f"{backend} sizes its KV cache from its context, not from memory")
    arch, why = _arch(row, pl)
    if arch is None:
        return fail(why or "no architecture")
    if not kv or base["gpu_gib"] is None or arch.weights_gib is None:
        return fail("the row lacks its KV dtype, GPU size or weights")
    kv_bytes = pl.kv_bytes if isinstance(pl.kv_bytes, dict) else {}
    dtype_bytes = _num(kv_bytes.get(planner.AUTO_KV_DTYPE)) if kv == planner.AUTO_KV_DTYPE else None
    arch = ModelArch(arch.n_layers, arch.n_kv_heads, arch.head_dim, arch.params_b, arch.weights_gib, None,
                     dtype_bytes, arch.sources, arch.name)
    try:
        p = planner.plan_job(arch, str(kv), cache, base["gpu_gib"], prompt_tokens=1, max_tokens=0, levels=[],
                             gpu_memory_utilization=_num(row.gpu_memory_utilization) or _num(pl.gpu_memory_utilization),
                             block_size=_num(pl.block_size), overhead_gib=_num(pl.overhead_gib))
    except ValueError as e:
        return fail(str(e))
    mine = p["capacity_tokens"]
    return Check(**base, kvexp_tokens=mine, agrees=None if doc is None else int(doc) == mine,
                 inputs=PlanInputs.from_json({**p["inputs"], "backend": backend, "block_size": p["block_size"]}))


def check_document(aggregate: Aggregate) -> list[Check]:
    """Every calibration row of the aggregate, recomputed by kvexp's planner."""
    rows = aggregate.calibration or []
    # a row without a GPU size (a CPU run) holds no prediction to recompute: a GPU's capacity needs its size
    return [check_row(i, r, aggregate) for i, r in enumerate(rows) if r.gpu_gib is not None]


def kvexp_tokens(row: CalibrationRow, aggregate: Aggregate) -> Optional[int]:
    """kvexp's own predicted capacity for one calibration row (None: it cannot be recomputed)."""
    return check_row(0, row, aggregate).kvexp_tokens
