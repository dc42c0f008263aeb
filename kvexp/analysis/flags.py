"""Levels whose numbers should not be read as firm, found in a document: the warnings a kvexp run
recorded itself (metrics/levels.py made them while measuring), and for levels that carry none (the
reference document, other tools' files) the same checks with the same thresholds and texts
(levels.figure_warnings), made here on the figures the document holds; a failed level; throughput
unstable across a level's repeats (stats.repeat_summary's coefficient of variation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from kvexp.analysis.documents import first_line, fmt_x, is_num, x_words
from kvexp.metrics import stats
from kvexp.metrics.levels import (MAX_CV, TAGS, WARNING_CODES as LEVEL_WARNING_CODES, Level, LevelWarning,
                                  figure_warnings)
from kvexp.results.runs import Aggregate


@dataclass(frozen=True)
class Flag:
    """One level of one run of a document flagged by one warning (code: levels.WARNING_CODES, or
    "failed"; tag: the short mark of a table cell)."""

    code: str
    tag: str
    run_index: int
    level_index: int  # index into run.levels as given
    label: str
    scenario: str
    message: str


def repeat_stats(level: Level) -> dict[str, Optional[float]]:
    """n, cv (a fraction) and ci95 of throughput over repeats, from the level's `repeats` summary
    ({"throughput_tok_s": {n, cv, ci95, mean}, ...}, or one such summary), or from the repeats a
    merged level holds (Level.merge)."""
    out: dict[str, Any] = {"n": None, "cv": None, "ci95": None}
    if isinstance(level.repeats, dict):
        own = "repeats.throughput_tok_s" if isinstance(level.value("repeats.throughput_tok_s"), dict) else "repeats"
        n, ci95 = level.value(f"{own}.n"), level.value(f"{own}.ci95")
        out.update(n=n if n is not None else level.value("repeats.n"), cv=level.value(f"{own}.cv"),
                   ci95=ci95 if ci95 is not None else level.value("repeats.throughput_ci95"))
    vals = level.repeat_throughputs
    if vals is not None and len(vals) >= 2 and out["cv"] is None:
        out["n"] = out["n"] or len(vals)
        out["cv"] = stats.repeat_summary(list(vals))["cv"]  # type: ignore[index]
    return out


def _unstable(cv: Optional[float], n: Optional[float]) -> Optional[LevelWarning]:
    if cv is None or cv < MAX_CV:
        return None
    across = f" across {n:g} repeats" if is_num(n) else " across repeats"
    return LevelWarning("unstable", f"throughput varies by {cv * 100:.1f} %{across} (CV ≥ {MAX_CV * 100:.0f} %)",
                        {"cv": cv, "n": n})


def level_warnings(aggregate: Aggregate) -> list[Flag]:
    """Every flagged level of the document's runs, in run and level order: a failed level; the warnings
    a level recorded (shown with their own texts), else figure_warnings on its figures; a CV across
    repeats at or above MAX_CV, from the level's own repeat summary or from its repeat entries."""
    out: list[Flag] = []
    for ri, run in enumerate(aggregate.runs):
        label, scen = run.label, str(run.scenario or "unnamed")
        first_of: dict[tuple[str, float], int] = {}
        repeats: dict[tuple[str, float], list[float]] = {}
        for li, level in enumerate(run.levels):
            x = level.x
            where = f"{label} at {x_words(x[0])} {fmt_x(*x)}" if x else f"{label} level {li + 1}"
            if x and (level.repeat or 0) > 0:
                where += f" (repeat {level.repeat})"

            def add(w: LevelWarning) -> None:
                out.append(Flag(w.code, TAGS.get(w.code, w.code), ri, li, label, scen, f"{where}: {w.text}"))

            if x is not None:
                first_of.setdefault(x, li)
                if is_num(level.throughput_tok_s) and not level.failed:
                    repeats.setdefault(x, []).append(float(level.throughput_tok_s))  # type: ignore[arg-type]
            if level.failed:
                reason = first_line(level.status_reason)
                add(LevelWarning("failed", "the level failed" + (f": {reason}" if reason else "")))
            recorded = level.warnings_recorded
            for w in level.warnings if recorded else figure_warnings(level):
                add(w)
            rs = repeat_stats(level)
            if not (recorded and any(w.code == "unstable" for w in level.warnings)) and \
                    (w := _unstable(rs["cv"], rs["n"])) is not None:
                add(w)
        for x, vals in repeats.items():
            summary = stats.repeat_summary(vals)
            if len(vals) >= 2 and summary and (w := _unstable(summary["cv"], len(vals))) is not None:
                li = first_of[x]
                out.append(Flag(w.code, TAGS[w.code], ri, li, label, scen,
                                f"{label} at {x_words(x[0])} {fmt_x(*x)}: {w.text}"))
    return out


# tag -> what it means, for a report's legend: the codes a run records (levels.WARNING_CODES) under
# the marks tables show, and "failed".
WARNING_CODES = {**{TAGS.get(code, code): meaning for code, meaning in LEVEL_WARNING_CODES.items()},
                 "failed": "the level failed", "warn": "warning recorded by the run"}
