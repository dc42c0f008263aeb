"""Calibration: the planner's prediction against what the engine reported, and fitted overheads.

For each measured job: predicted vs engine-reported KV capacity and the error in percent, in the
reference document's `calibration` row shape. From the same jobs, a fitted overhead per
(backend, GPU name, KV dtype): the overhead that makes the prediction equal the measurement
(vLLM: the KV capacity it reported; llama.cpp/Ollama, whose capacity is the configured context:
the peak GPU memory measured), averaged over the jobs of one key. The fits live in a small JSON file
(default ~/.cache/kvexp/calibration.json; env KVEXP_CALIBRATION or a `path` argument overrides) that
later predictions use through `lookup_overhead_gib`.

The maths is pure; `load` and `save` are the only functions that touch the file system."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from kvexp.backends import find
from kvexp.capacity.planner import (DEFAULT_BLOCK_SIZE, DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_OVERHEAD_GIB, GIB_BYTES,
                                    ModelArch, canonical_kv_dtype, capacity_from_kv_bytes, kv_bytes_per_element,
                                    kv_bytes_per_token, overhead_for_capacity, vllm_capacity_tokens)
from kvexp.core.paths import atomic_write, cache_dir
from kvexp.results.blocks import PlanInputs
from kvexp.results.documents import JobResult
from kvexp.results.runs import Run

SCHEMA_VERSION = 1
KIND = "kvexp-calibration"
ENV_PATH = "KVEXP_CALIBRATION"
REFERENCE_ROW_KEYS = ("model", "preset", "kv_cache_dtype", "gpu_gib", "weights_gib",
                      "gpu_memory_utilization", "predicted_tokens", "actual_tokens", "error_pct")


class CalibrationError(ValueError):
    """A calibration file kvexp cannot use; the message is one line naming the file."""


@dataclass(frozen=True)
class Measurement:
    """What one measured job says about KV capacity and memory (None: not measured / unknown)."""

    backend: str
    model: str
    kv_dtype: str  # the backend's spelling (auto, fp8, f16, q8_0, ...)
    gpu_name: Optional[str]
    gpu_gib: Optional[float]
    weights_gib: Optional[float]
    kv_bytes_per_token: Optional[float]
    gpu_memory_utilization: Optional[float] = None
    block_size: Optional[int] = None
    actual_tokens: Optional[int] = None  # engine-reported KV capacity (vLLM blocks x block_size)
    kv_cache_bytes: Optional[float] = None  # engine-reported KV bytes (llama.cpp log)
    peak_vram_gib: Optional[float] = None
    preset: Optional[str] = None
    dtype_bytes: Optional[float] = None
    job_id: Optional[str] = None
    kv_cache_memory_bytes: Optional[int] = None  # vLLM --kv-cache-memory-bytes, if the job set it

    @property
    def kv_key(self) -> str:
        return canonical_kv_dtype(self.kv_dtype, self.dtype_bytes)

    @property
    def paged(self) -> bool:
        """The backend sizes a paged KV pool from memory (vLLM): its capacity is a prediction to check."""
        adapter = find(self.backend)
        return adapter is not None and adapter.cache_model.paged


# ---------------------------------------------------------------------------------------------------
# Reading measurements out of runs (pure)


Measured = Run | JobResult  # a run of an aggregate (the reference document's included), or a job's result


def measurement_from_run(run: Measured, arch: Optional[ModelArch] = None) -> Optional[Measurement]:
    """A Measurement from one run of an aggregate (the reference document's runs included) or a kvexp job
    result (the architecture from its `planner` block's `inputs`, else from `arch`). None without a
    backend and a KV dtype."""
    if isinstance(run, JobResult):
        backend, kv_asked, model = run.backend.name, run.kv.backend_dtype, run.model.path or run.model.name
        gpu_name, gpu_gib, preset = run.gpu.name, run.gpu.memory_gib, run.model.name
    else:
        backend, kv_asked, model = run.backend, None, run.model
        gpu_name, gpu_gib, preset = run.gpu, run.gpu_gib, None
    kv = run.kv_cache
    plan_inputs = (run.planner.inputs if run.planner is not None else None) or PlanInputs()
    kv_dtype = kv.dtype or plan_inputs.kv_dtype or kv_asked
    if not backend or not kv_dtype:
        return None

    def pick(key: str) -> Any:
        v = getattr(plan_inputs, key)
        return getattr(arch, key, None) if v is None and arch is not None else v

    dtype_bytes = pick("dtype_bytes")
    try:
        bpe = kv_bytes_per_element(str(kv_dtype), dtype_bytes)
    except ValueError:
        bpe = None
    bpt = kv_bytes_per_token(pick("n_layers"), pick("n_kv_heads"), pick("head_dim"), bpe)
    actual = kv.capacity_tokens
    if actual is None and kv.blocks is not None and kv.block_size is not None:
        actual = int(kv.blocks) * int(kv.block_size)
    peaks = [lv.peak_vram_gib for lv in run.levels if lv.peak_vram_gib is not None]
    if not peaks:
        peaks = [lv.peak_server_gpu_gib for lv in run.levels if lv.peak_server_gpu_gib is not None]
    util = kv.gpu_memory_utilization
    if util is None:
        util = plan_inputs.gpu_memory_utilization
    if gpu_gib is None:
        gpu_gib = plan_inputs.gpu_gib
    started = run.started_at or ""
    return Measurement(
        backend=str(backend), model=(None if model is None else str(model)) or (arch.name if arch else "") or "",
        kv_dtype=str(kv_dtype), gpu_name=gpu_name, gpu_gib=gpu_gib,
        weights_gib=pick("weights_gib"), kv_bytes_per_token=bpt, gpu_memory_utilization=util,
        block_size=kv.block_size, actual_tokens=actual, kv_cache_bytes=kv.bytes,
        peak_vram_gib=max(peaks) if peaks else None,
        preset=preset or plan_inputs.model or (arch.name if arch else None),
        dtype_bytes=dtype_bytes, job_id=None if run.label is None else f"{run.label}@{started}",
        kv_cache_memory_bytes=plan_inputs.kv_cache_memory_bytes,
    )


def measurements_from_runs(runs: Iterable[Measured], archs: Mapping[str, ModelArch] | None = None
                           ) -> list[Measurement]:
    """Measurements of every run; `archs` maps a run's model (a job's preset, or its file) to its
    architecture."""
    out = []
    for run in runs:
        names = (run.model.name, run.model.path) if isinstance(run, JobResult) else (run.model,)
        arch = next((archs[n] for n in names if archs and n in archs), None)
        m = measurement_from_run(run, arch)
        if m is not None:
            out.append(m)
    return out


# ---------------------------------------------------------------------------------------------------
# Predictions, errors, rows (pure)


def predicted_tokens(m: Measurement, overhead_gib: float = DEFAULT_OVERHEAD_GIB) -> Optional[int]:
    """The planner's vLLM KV capacity for this job's inputs (None if not vLLM or inputs unknown)."""
    if not m.paged or m.kv_bytes_per_token is None:
        return None
    if m.kv_cache_memory_bytes is not None:
        return capacity_from_kv_bytes(m.kv_cache_memory_bytes, m.kv_bytes_per_token,
                                      m.block_size or DEFAULT_BLOCK_SIZE)
    if m.gpu_gib is None or m.weights_gib is None:
        return None
    return vllm_capacity_tokens(
        m.gpu_gib, m.weights_gib, m.kv_bytes_per_token,  # type: ignore[arg-type]
        gpu_memory_utilization=m.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION,
        overhead_gib=overhead_gib, block_size=m.block_size or DEFAULT_BLOCK_SIZE)


def predicted_peak_gib(m: Measurement, overhead_gib: float = DEFAULT_OVERHEAD_GIB) -> Optional[float]:
    """weights + reported KV bytes + overhead (llama.cpp/Ollama; None if unknown)."""
    if m.weights_gib is None or m.kv_cache_bytes is None:
        return None
    return m.weights_gib + m.kv_cache_bytes / GIB_BYTES + overhead_gib


def error_pct(predicted: Optional[float], actual: Optional[float]) -> Optional[float]:
    """(predicted - actual) / actual x 100, to one decimal."""
    if predicted is None or not actual:
        return None
    return round((predicted - actual) / actual * 100, 1)


def calibration_row(m: Measurement, overhead_gib: float = DEFAULT_OVERHEAD_GIB) -> Optional[dict[str, Any]]:
    """The reference document's calibration row for a vLLM job (None for other backends / no capacity)."""
    pred = predicted_tokens(m, overhead_gib)
    if pred is None or m.actual_tokens is None:
        return None
    return {
        "model": m.model, "preset": m.preset, "kv_cache_dtype": m.kv_dtype, "gpu_gib": m.gpu_gib,
        "weights_gib": m.weights_gib,
        "gpu_memory_utilization": m.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION,
        "predicted_tokens": pred, "actual_tokens": m.actual_tokens,
        "error_pct": error_pct(pred, m.actual_tokens),
    }


def _measurements(items: Iterable[Measurement | Measured]) -> list[Measurement]:
    out = []
    for it in items:
        m = it if isinstance(it, Measurement) else measurement_from_run(it)
        if m is not None:
            out.append(m)
    return out


def calibration_rows(items: Iterable[Measurement | Measured]) -> list[dict[str, Any]]:
    """Reference-shaped rows, one per distinct configuration (jobs that share one engine setup —
    e.g. two scenarios on one server config — give one row). Takes Measurements, or job results /
    runs whose architecture comes from their `planner` block."""
    rows: list[dict[str, Any]] = []
    for m in _measurements(items):
        row = calibration_row(m)
        if row is not None and row not in rows:
            rows.append(row)
    return rows


def fit_overhead_gib(m: Measurement) -> Optional[float]:
    """The overhead that makes the prediction equal this job's measurement: vLLM from the reported
    capacity, llama.cpp/Ollama from peak GPU memory (peak - weights - KV bytes); None if unknown."""
    if m.paged:
        if m.kv_cache_memory_bytes is not None:  # a fixed pool: no overhead in play
            return None
        if None in (m.actual_tokens, m.gpu_gib, m.weights_gib, m.kv_bytes_per_token):
            return None
        return overhead_for_capacity(
            m.actual_tokens, m.gpu_gib, m.weights_gib, m.kv_bytes_per_token,  # type: ignore[arg-type]
            gpu_memory_utilization=m.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION,
            block_size=m.block_size or DEFAULT_BLOCK_SIZE)
    if None in (m.peak_vram_gib, m.weights_gib, m.kv_cache_bytes):
        return None
    return m.peak_vram_gib - m.weights_gib - m.kv_cache_bytes / GIB_BYTES  # type: ignore[operator]


def _norm(s: Optional[str]) -> str:
    return " ".join((s or "unknown").split()).lower()


def _job_id(m: Measurement) -> str:
    return m.job_id or f"{m.model}|{m.kv_dtype}|{m.gpu_gib}|{m.actual_tokens}|{m.kv_cache_bytes}|{m.peak_vram_gib}"


def fit(measurements: Iterable[Measurement | Measured],
        previous: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """A calibration table from measured jobs, merged into `previous` (a job measured again replaces
    its earlier sample). Each entry's overhead_gib is the mean over its samples."""
    entries: dict[tuple[str, str, str], dict[str, Any]] = {}
    for e in (previous or {}).get("entries") or []:
        k = (_norm(e["backend"]), _norm(e["gpu"]), e["kv_dtype"])
        entries[k] = {**e, "samples": list(e.get("samples") or [])}
    for m in _measurements(measurements):
        o = fit_overhead_gib(m)
        if o is None:
            continue
        k = (_norm(m.backend), _norm(m.gpu_name), m.kv_key)
        e = entries.setdefault(k, {"backend": m.backend, "gpu": m.gpu_name, "kv_dtype": m.kv_key,
                                   "samples": []})
        jid = _job_id(m)
        e["samples"] = [s for s in e["samples"] if s.get("job") != jid]
        e["samples"].append({"job": jid, "model": m.model, "overhead_gib": o})
    out = []
    for e in entries.values():
        vals = [s["overhead_gib"] for s in e["samples"]]
        if vals:
            out.append({**e, "overhead_gib": sum(vals) / len(vals), "jobs": len(vals)})
    out.sort(key=lambda e: (e["backend"], e["gpu"] or "", e["kv_dtype"]))
    return {"schema_version": SCHEMA_VERSION, "kind": KIND, "entries": out}


def lookup_overhead_gib(table: Optional[Mapping[str, Any]], backend: str, gpu_name: Optional[str],
                        kv_dtype: str) -> Optional[float]:
    """The fitted overhead for (backend, GPU name, KV dtype), or None. kv_dtype may be any spelling
    (it is canonicalised: "auto", "bf16", "f16" all look up "fp16")."""
    if not table:
        return None
    key = (_norm(backend), _norm(gpu_name), canonical_kv_dtype(kv_dtype))
    for e in table.get("entries") or []:
        if (_norm(e.get("backend")), _norm(e.get("gpu")), e.get("kv_dtype")) == key:
            return e.get("overhead_gib")
    return None


def calibration_report(measurements: Iterable[Measurement | Measured],
                       table: Optional[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per job: the reference row keys plus backend, gpu, overhead_gib (default),
    calibrated_overhead_gib, calibrated_tokens, calibrated_error_pct; for llama.cpp/Ollama
    the memory prediction instead (predicted/calibrated_peak_memory_gib vs measured_peak_memory_gib)."""
    rows = []
    for m in _measurements(measurements):
        cal = lookup_overhead_gib(table, m.backend, m.gpu_name, m.kv_dtype)
        base = calibration_row(m) or {k: None for k in REFERENCE_ROW_KEYS}
        if base["model"] is None:
            base.update(model=m.model, preset=m.preset, kv_cache_dtype=m.kv_dtype, gpu_gib=m.gpu_gib,
                        weights_gib=m.weights_gib, gpu_memory_utilization=m.gpu_memory_utilization)
        cal_pred = None if cal is None else predicted_tokens(m, cal)
        peak = predicted_peak_gib(m)
        cal_peak = None if cal is None else predicted_peak_gib(m, cal)
        row = {
            **base, "backend": m.backend, "gpu": m.gpu_name, "overhead_gib": DEFAULT_OVERHEAD_GIB,
            "calibrated_overhead_gib": None if cal is None else round(cal, 4),
            "calibrated_tokens": cal_pred,
            "calibrated_error_pct": error_pct(cal_pred, m.actual_tokens),
            "predicted_peak_memory_gib": None if peak is None else round(peak, 4),
            "calibrated_peak_memory_gib": None if cal_peak is None else round(cal_peak, 4),
            "measured_peak_memory_gib": m.peak_vram_gib,
            "memory_error_pct": error_pct(peak, m.peak_vram_gib),
            "calibrated_memory_error_pct": error_pct(cal_peak, m.peak_vram_gib),
        }
        if row not in rows:
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------
# The file


def default_path() -> Path:
    """$KVEXP_CALIBRATION, else calibration.json in kvexp's cache folder (~/.cache/kvexp)."""
    env = os.environ.get(ENV_PATH)
    if env:
        return Path(os.path.expanduser(env))
    return cache_dir() / "calibration.json"


def load(path: Path | str | None = None) -> Optional[dict[str, Any]]:
    """The calibration table, or None when there is no file yet."""
    p = Path(path) if path is not None else default_path()
    try:
        with open(p, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as e:
        raise CalibrationError(f"calibration file {p}: cannot read it ({e}); delete it or fix it") from e
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise CalibrationError(f"calibration file {p}: not a kvexp calibration file")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise CalibrationError(f"calibration file {p}: schema_version {data.get('schema_version')!r} "
                               f"is not {SCHEMA_VERSION}; delete it and calibrate again")
    return data


def save(table: Mapping[str, Any], path: Path | str | None = None) -> Path:
    """Write the table atomically."""
    p = Path(path) if path is not None else default_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(p, json.dumps(table, indent=2) + "\n")


def update(measurements: Iterable[Measurement | Measured], path: Path | str | None = None) -> dict[str, Any]:
    """Fit these jobs into the calibration file (merging with what it holds) and save it."""
    table = fit(measurements, load(path))
    save(table, path)
    return table
