"""The report's planner section: the planner's constants and model presets, each run's predicted KV
capacity beside the server's, the predicted preemption and queueing points beside the observed ones,
the calibration table with kvexp's own recomputation, and the what-if table on other GPUs."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Optional

from kvexp import backends
from kvexp.analysis import runplan as RP
from kvexp.capacity.planner import kv_bytes_per_token
from kvexp.metrics import registry
from kvexp.metrics.registry import format_value, is_num
from kvexp.planning import recompute, whatif
from kvexp.planning.memory import memory_check, parts_words
from kvexp.planning.calibration import CalibrationError, load as load_calibration
from kvexp.report.tables import Table, drop_empty, level_cell
from kvexp.results.blocks import PlannerConstants
from kvexp.results.runs import Aggregate

log = logging.getLogger(__name__)
MIB = 1 << 20


def planner_view(agg: Aggregate) -> dict:
    """The planner section's constants and tables, as strings."""
    pl = agg.planner or PlannerConstants()
    constants: list[tuple[str, str]] = []
    names = {"gpu_memory_utilization": "GPU memory utilisation", "overhead_gib": "Overhead (GiB)",
             "block_size": "Block size (tokens)"}
    for k, v in (agg.planner.to_json() if agg.planner is not None else {}).items():  # as the document has them
        if k in ("gib", "models", "kv_bytes"):
            continue
        if k in ("gpu_memory_utilization", "overhead_gib") and not _has_gpu(agg):
            continue  # a share of GPU memory, a GPU's overhead: nothing where no run had a GPU (CPU: RSS)
        if k == "gpu_memory_utilization" and is_num(v):
            constants.append((names[k], f"{v * 100:.0f} %"))
        elif not isinstance(v, (dict, list)):
            constants.append((names.get(k, k), format_value(k, v)))
    kvb = pl.kv_bytes if isinstance(pl.kv_bytes, dict) else {}
    if kvb:
        constants.append(("KV bytes per element", ", ".join(f"{k} {format_value('b', v)}" for k, v in kvb.items())))

    presets = None
    if pl.models:
        rows = []
        for name, m in pl.models.items():
            dims = m.dims
            per_tok = [f"{dt} {kv_bytes_per_token(*dims, b) / 1024:.1f}" for dt, b in kvb.items()
                       if dims is not None and is_num(b)]
            rows.append([name, format_value("n", m.n_layers), format_value("n", m.n_kv_heads),
                         format_value("n", m.head_dim), format_value("params_b", m.params_b),
                         ", ".join(per_tok) or "—"])
        presets = Table(["Preset", "Layers", "KV heads", "Head dim", "Params (B)", "KV KiB/token"], rows,
                        [False, True, True, True, True, False])

    plans = [(r, RP.run_plan(r, agg)) for _, sruns in agg.scenarios() for r in sruns]
    cap_rows = []
    for r, p in plans:  # one row per run: each run's own planner error, never one row for several runs
        if p is None:
            continue
        kv = r.kv
        server = r.kv_cache.capacity
        diff = (server - p.capacity_tokens) / p.capacity_tokens * 100 if server and p.capacity_tokens else None
        server_bytes = float(r.kv_cache.bytes) if is_num(r.kv_cache.bytes) else None
        mem_diff = ((server_bytes - p.kv_cache_bytes) / p.kv_cache_bytes * 100
                    if server_bytes and p.kv_cache_bytes else None)
        per_token = format_value("kv_bytes_per_token", p.kv_bytes_per_token)
        if per_token != registry.UNKNOWN:
            per_token += registry.window_words(p.window_bytes_per_sequence)
        cap_rows.append([r.label, r.backend_name, str(r.model), kv.display,
                         per_token,
                         format_value("capacity_tokens", p.capacity_tokens),
                         format_value("capacity_tokens", p.calibrated_capacity_tokens),
                         format_value("capacity_tokens", server),
                         "—" if diff is None else f"{diff:+.1f}",
                         "—" if p.kv_cache_bytes is None else f"{p.kv_cache_bytes / MIB:,.2f}",
                         "—" if server_bytes is None else f"{server_bytes / MIB:,.2f}",
                         "—" if mem_diff is None else f"{mem_diff:+.1f}", p.source])
    capacity = Table(["Run", "Backend", "Model", "KV", "KV bytes/token", "Planner capacity (tokens)",
                      "Calibrated capacity (tokens)", "Server capacity (tokens)", "Server vs planner (%)",
                      "Planner KV (MiB)", "Server KV (MiB)", "Server vs planner KV (%)", "Source"],
                     cap_rows, [False] * 4 + [True] * 8 + [False], kind="wide") if cap_rows else None

    pre_rows = []
    for r, p in plans:
        if p is None:
            continue
        levels = [lv for lv in r.merged_levels() if lv.x and lv.x[0] == "concurrency"]
        top = format_value("concurrency", levels[-1].number("concurrency")) if levels else "—"

        def first(rows: tuple[RP.PlanLevel, ...], what: str) -> str:
            hit = next((q for q in rows if getattr(q, what)), None)
            if hit:
                return format_value("concurrency", hit.x)
            known = [q for q in rows if getattr(q, what) is not None]
            return f"none up to {format_value('concurrency', known[-1].x)}" if known else "—"

        if r.exposes("preemptions"):
            obs = next((lv for lv in levels if lv.number("preemptions")), None)
            observed = format_value("concurrency", obs.concurrency) if obs else f"none up to {top}"
        else:
            observed = registry.missing_text("preemptions", level_failed=False, exposed_elsewhere=False,
                                             foreign=bool(r.tool))
        pre_rows.append([
            str(r.scenario), r.label, format_value("tokens", p.tokens_per_request),
            format_value("concurrency", p.max_concurrency),
            format_value("concurrency", p.calibrated_max_concurrency),
            first(p.levels, "predicts_preemption"), first(p.calibrated_levels, "predicts_preemption"), observed,
            format_value("concurrency", p.max_concurrent_requests), first(p.levels, "predicts_queueing"),
            level_cell(r, levels[-1], "peak_kv_cache_usage") if levels else "—",
        ])
    preemption = Table(["Scenario", "Run", "Tokens/request", "Max concurrency (planner)",
                        "Max concurrency (calibrated)", "Predicted preemption at", "Predicted (calibrated)",
                        "Observed preemption at", "Served at once (planner)", "Predicted queueing at",
                        "Peak KV usage at top level (%)"],
                       pre_rows, [False, False, *[True] * 9], kind="wide") if pre_rows else None
    if preemption is not None:
        preemption = drop_empty(preemption, keep=2)

    cal = agg.calibration or []
    calibration = None
    if cal:
        has_cal = any(row.calibrated_tokens is not None for row in cal)
        cols = [("model", "Model", False), ("preset", "Preset", False), ("backend", "Backend", False),
                ("kv_cache_dtype", "KV", False), ("gpu_gib", "GPU (GiB)", True), ("weights_gib", "Weights (GiB)", True),
                ("gpu_memory_utilization", "GPU mem. util. (%)", True),
                ("predicted_tokens", "Predicted (tokens)", True),
                ("actual_tokens", "Actual (tokens)", True), ("error_pct", "Error (%)", True)]
        if has_cal:
            cols += [("calibrated_tokens", "Calibrated (tokens)", True),
                     ("calibrated_error_pct", "Calibrated error (%)", True)]
        cols = [c for c in cols if c[0] != "backend" or any(row.backend for row in cal)]
        cols = [c for c in cols if c[0] != "gpu_memory_utilization" or any(is_num(row.gpu_gib) for row in cal)]
        checks = {c.index: c for c in recompute.check_document(agg)}
        rows = []
        for i, row in enumerate(cal):
            vals = {k: getattr(row, k) for k, _, _ in cols}
            actual = row.actual_tokens
            for pred, err in (("predicted_tokens", "error_pct"), ("calibrated_tokens", "calibrated_error_pct")):
                if err in vals and vals[err] is None and is_num(getattr(row, pred)) and is_num(actual) and actual:
                    vals[err] = (getattr(row, pred) - actual) / actual * 100
            rows.append([format_value(k, vals[k]) for k, _, _ in cols] + _check_cells(checks.get(i)))
        calibration = Table([h for _, h, _ in cols] + list(CHECK_HEADERS), rows,
                            [n for _, _, n in cols] + [True, True, False], kind="wide")
    return {"constants": constants, "presets": presets, "capacity": capacity, "preemption": preemption,
            "memory": memory_view(agg), "calibration": calibration, "whatif": whatif_view(agg),
            "derived": any(p is not None and p.source == "calibration table" for _, p in plans)}


def _gib3(v: Optional[float]) -> str:
    return registry.UNKNOWN if v is None else f"{v:.3f}"  # MiB apart: the figures a prediction is held to


def memory_view(agg: Aggregate) -> Optional[Table]:
    """Each run's predicted peak memory beside the measured one: on the CPU the RSS of the server's
    processes, with the prediction's parts; on a GPU its memory (kvexp/planning/memory.py)."""
    rows = []
    for _, sruns in agg.scenarios():
        for r in sruns:
            c = memory_check(r.planner, r.levels, bool(r.gpu or r.gpu_gib))
            if c is None:
                continue
            err = c.error_pct
            rows.append([r.label, r.backend_name, r.kv.display, c.words,
                         _gib3(c.predicted_gib), _gib3(c.measured_gib),
                         "—" if err is None else f"{err:+.1f}", parts_words(c)])
    if not rows:
        return None
    return Table(["Run", "Backend", "KV", "Memory measured", "Planner peak (GiB)", "Measured peak (GiB)",
                  "Measured vs planner (%)", "Planner's parts"], rows,
                 [False] * 4 + [True] * 3 + [False], kind="wide")


CHECK_HEADERS = ("kvexp planner (tokens)", "kvexp error (%)", "Document vs kvexp")


def _check_cells(c: Optional[recompute.Check]) -> list[str]:
    """kvexp's own prediction for a calibration row, its error, and whether the document agrees."""
    if c is None or c.kvexp_tokens is None:
        return ["—", "—", "not recomputed" + (f": {c.reason}" if c is not None and c.reason else "")]
    verdict = ("agrees" if c.agrees else "no prediction in the document" if c.agrees is None
               else f"DISAGREES: document {c.document_tokens:,}")
    return [format_value("capacity_tokens", c.kvexp_tokens), format_value("error_pct", c.kvexp_error_pct),
            verdict]


def _whatif_configs(agg: Aggregate) -> list[tuple[tuple, Optional[str]]]:
    """What-if configurations of an aggregate with their scenario: every run's own planner block, and
    every calibration row kvexp recomputed (with the prompt and output length of its runs)."""
    out: dict[tuple, tuple[tuple, Optional[str]]] = {}
    checks = [c for c in recompute.check_document(agg) if c.kvexp_tokens is not None]
    for r in agg.runs:
        adapter = backends.find(r.backend)
        if adapter is None:
            continue
        p = r.planner
        configs = []
        if p is not None and p.inputs is not None:
            configs.append(whatif.from_plan(p, adapter.cache_model))
        for c in checks:
            if (c.backend == adapter.name and str(c.model) == str(r.model)
                    and r.kv_cache.dtype == c.kv_dtype and is_num(r.prompt_tokens)):
                inputs = replace(c.inputs, prompt_tokens=r.prompt_tokens, max_tokens=r.max_tokens or 0)
                configs.append((inputs, {}, adapter.cache_model, adapter.name))
        for cfg in configs:
            i = cfg[0]
            key = (cfg[3], i.model, i.kv_dtype, i.prompt_tokens, i.max_tokens)
            out.setdefault(key, (cfg, str(r.scenario)))
    return list(out.values())


def whatif_view(agg: Aggregate) -> Optional[Table]:
    """The what-if table: each configuration on each conf/gpu preset, with this machine's fitted
    overheads (the calibration file; none when it cannot be read)."""
    configs = _whatif_configs(agg)
    if not configs:
        return None
    try:
        table = load_calibration()
    except CalibrationError as e:
        log.warning("%s", e)
        table = None
    rows = []
    for g in whatif.gpu_presets():
        for cfg, scen in configs:
            rows.append(whatif.row_cells(whatif.what_if(cfg[0], cfg[1], cfg[2], g, table, backend=cfg[3]), scen))
    return Table(list(whatif.HEADERS), rows, [False] * 6 + [True] * 3 + [False] + [True] * 3, kind="wide")



def _has_gpu(agg: Aggregate) -> bool:
    return bool(agg.gpu or agg.gpu_gib or any(r.gpu for r in agg.runs))
