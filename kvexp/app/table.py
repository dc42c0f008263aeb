"""`kvexp results` on a terminal: the levels of any mix of result files as an aligned plain-text table of
the figures a reviewer compares first (the CSV, `--csv`, has every column). Headers and number formats
are the metric registry's; a figure that is unknown is "—", one the backend does not expose says so."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Optional

from kvexp.metrics import registry
from kvexp.metrics.levels import Level
from kvexp.report.tables import Table, level_cell, text_table
from kvexp.results.runs import Aggregate, Run

FIGURES = ("throughput_tok_s", "ttft_p50_ms", "tpot_p50_ms", "peak_kv_cache_usage")


def _known(v: Any) -> bool:
    return v is not None and not (isinstance(v, float) and not math.isfinite(v))


def _cell(run: Run, level: Optional[Level], key: str) -> str:
    """A level's figure as the report writes it; None, NaN and infinities are unknown ("—")."""
    level = level if level is not None else Level.from_json({})  # a run without levels: one row of unknowns
    value = level.value(key)
    if value is not None and not _known(value):
        level = replace(level, **{key: None})
    text = level_cell(run, level, key)
    return text if text not in ("None", "nan", "") else registry.UNKNOWN


def _text(v: Any) -> str:
    return str(v) if _known(v) and str(v) != "" else registry.UNKNOWN


def results_table(aggregate: Aggregate) -> str:
    """One row per level of every run (a run without levels: one row of "—"), aligned in columns."""
    runs = aggregate.runs
    levels: list[tuple[Run, Optional[Level]]] = [(r, lv) for r in runs for lv in (r.levels or [None])]
    open_loop = any(lv is not None and (lv.x or ("",))[0] == "rate" for _, lv in levels)
    status = any(r.state != "complete" for r in runs)
    load = ["concurrency", *(["rate"] if open_loop else [])]
    head = ["job", "backend", "kv", *(["status"] if status else []),
            *(registry.metric(k).header for k in (*load, *FIGURES))]
    numeric = [False, False, False, *([False] if status else []), *([True] * (len(load) + len(FIGURES)))]
    rows = []
    for r, lv in levels:
        rows.append([_text(r.label), _text(r.backend), _text(r.kv.name),
                     *([_text(r.state)] if status else []),
                     *(_cell(r, lv, k) for k in (*load, *FIGURES))])
    out = text_table(Table(head, rows, numeric))
    out.append(f"{len(rows)} row(s) from {len(runs)} run(s); --csv for every column")
    return "\n".join(out) + "\n"
