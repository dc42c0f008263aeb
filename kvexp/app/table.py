"""`kvexp results` on a terminal: the levels of any mix of result files as an aligned plain-text table of
the figures a reviewer compares first (the CSV, `--csv`, has every column). Headers and number formats
are the metric registry's; a figure that is unknown is "—", one the backend does not expose says so."""

from __future__ import annotations

import math
from typing import Any

from kvexp.analysis import documents as D
from kvexp.metrics import registry
from kvexp.metrics.levels import level_x
from kvexp.report.tables import Table, level_cell, text_table

FIGURES = ("throughput_tok_s", "ttft_p50_ms", "tpot_p50_ms", "peak_kv_cache_usage")


def _known(v: Any) -> bool:
    return v is not None and not (isinstance(v, float) and not math.isfinite(v))


def _cell(run: dict[str, Any], level: dict[str, Any], key: str) -> str:
    """A level's figure as the report writes it; None, NaN and infinities are unknown ("—")."""
    value = registry.level_value(level, key)
    if value is not None and not _known(value):
        level = {**level, key: None}
    text = level_cell(run, level, key)
    return text if text not in ("None", "nan", "") else registry.UNKNOWN


def _text(v: Any) -> str:
    return str(v) if _known(v) and str(v) != "" else registry.UNKNOWN


def results_table(aggregate: dict[str, Any]) -> str:
    """One row per level of every run (a run without levels: one row of "—"), aligned in columns."""
    runs = list(aggregate.get("runs") or [])
    levels = [(r, lv) for r in runs for lv in (r.get("levels") or [{}])]
    open_loop = any((level_x(lv) or ("",))[0] == "rate" for _, lv in levels)
    status = any(D.run_status(r) != "complete" for r in runs)
    load = ["concurrency", *(["rate"] if open_loop else [])]
    head = ["job", "backend", "kv", *(["status"] if status else []),
            *(registry.metric(k).header for k in (*load, *FIGURES))]
    numeric = [False, False, False, *([False] if status else []), *([True] * (len(load) + len(FIGURES)))]
    rows = []
    for r, lv in levels:
        rows.append([_text(r.get("label")), _text(r.get("backend")), _text(D.kv_name(r).name),
                     *([_text(D.run_status(r))] if status else []),
                     *(_cell(r, lv, k) for k in (*load, *FIGURES))])
    out = text_table(Table(head, rows, numeric))
    out.append(f"{len(rows)} row(s) from {len(runs)} run(s); --csv for every column")
    return "\n".join(out) + "\n"
