"""The PDF of a large report (render.is_large: a scenario of more runs than its charts show, or more
levels than a PDF lays out in seconds): a digest of the full report's context, not its every table. A
thousand runs are some twenty thousand table rows: a PDF of them takes WeasyPrint minutes and no one
reads it; comparison.csv (every run and level) and report.html / report.md beside it hold them all.

The digest keeps the verdicts, the ranking, the KV-dtype cards (one row per KV configuration: its best
run's), per scenario its best runs (the ones its charts show, scenario_view.best_runs), one row each at
its peak throughput, and its charts, the quality chart and its runs' rows, the setup's facts and the
planner's constants; the first few findings of each kind, stability warnings, failures and runs a
verdict leaves out, each list saying how many more the HTML holds. Tables of one row per run (the
setup's runs and KV caches, the planner's capacities) and the launch commands stay in the HTML. A note
at the top says where the full tables are."""

from __future__ import annotations

from typing import Any

from kvexp.analysis.aggregate import interpretation
from kvexp.analysis.card import CARD_HEADERS, card_rows
from kvexp.analysis.documents import backend_name
from kvexp.analysis.verdict import short_names
from kvexp.report.tables import Table, peak_table
from kvexp.results.runs import Aggregate

FULL = "comparison.csv (every run and level) and report.html"
LIST_ITEMS = 8  # findings of one kind, warnings, failures, runs a verdict leaves out: the first this many


def _runs_only(t: Any, keep: set[str]) -> Any:
    """A table's rows of the kept runs (by its "Run" column); a table without one as it is."""
    if not isinstance(t, Table) or "Run" not in t.headers:
        return t
    i = t.headers.index("Run")
    return Table(t.headers, [row for row in t.rows if row[i] in keep], t.numeric, t.kind)


def _first(items: list[str], what: str) -> list[str]:
    """The first LIST_ITEMS lines, and a line saying how many more the full report holds."""
    if len(items) <= LIST_ITEMS:
        return items
    return items[:LIST_ITEMS] + [f"… and {len(items) - LIST_ITEMS:,} more {what}: {FULL}."]


def _cards(cards: list[dict], ranking: dict[str, list[str]]) -> list[dict]:
    """The KV-dtype cards with the baseline row and, per KV configuration, its best-ranked run's row."""
    out = []
    for c in cards:
        order = {label: i for i, label in enumerate(ranking.get(c["scenario"], []))}
        base, others = c["rows"][0], c["rows"][1:]
        best: dict[str, dict] = {}
        for row in others:
            kv = str(row["kv"])
            if kv not in best or order.get(row["label"], 1 << 30) < order.get(best[kv]["label"], 1 << 30):
                best[kv] = row
        kept = {id(r) for r in best.values()}
        card = {**c, "rows": [base] + [r for r in others if id(r) in kept]}
        out.append({"title": f"{backend_name(c['backend'])}, {c['model']} ({c['weights']}), scenario "
                             f"{c['scenario']}: each KV configuration (its best run) against the {c['baseline']} "
                             "cache",
                    "table": Table(CARD_HEADERS, card_rows(card),
                                   [False, False, True, True, False, False, True, True, True], kind="wide")})
    return out


def digest(ctx: dict, aggregate: Aggregate) -> dict:
    """The context of a large report's PDF, from the full report's (render.start_context, its charts drawn)
    and the aggregate it was made from."""
    ranking = {sc["name"]: sc["ranking"] for sc in ctx["scenarios"]}
    by_label = {r.label: r for r in aggregate.runs}
    quality = ctx.get("quality")
    scenarios = []
    for sc in ctx["scenarios"]:
        best = [by_label[label] for label in sc["best"]]
        note = (f"The {len(best)} best of the scenario's {sc['run_count']:,} runs (the charts' runs), each at its peak "
                f"throughput; every run's levels, and the latency, load and workload detail tables, are in {FULL}."
                if len(best) < sc["run_count"] else
                f"Each run at its peak throughput; its levels, and the latency, load and workload detail tables, "
                f"are in {FULL}.")
        scenarios.append({**sc, "table": peak_table(best, short_names(best), first="Run"), "details": [], "codes": [],
                          "kv_label_note": False, "failed": [f for f in sc["failed"] if f["label"] in sc["best"]],
                          "notes": [note, *sc["notes"]]})
    # per-run tables stay in the HTML: the setup's runs and KV caches, the planner's capacity and preemption
    setup = {**ctx["setup"], "launches": [], "runs": None, "kv": None, "kv_unreported": []}
    planner = {**(ctx.get("planner") or {}), "capacity": None, "preemption": None}
    if quality:  # the runs its chart draws
        quality = {**quality, "table": _runs_only(quality["table"], set(quality.get("best") or ()))}
    verdicts = [{**v, "excluded": _first(list(v.get("excluded") or []), "runs left out")} for v in ctx["verdicts"]]
    findings = [{**g, "sentences": _first(g["sentences"], "findings of this kind")} for g in ctx["findings"]]
    failures = ctx["failures"]
    runs = len(aggregate.runs)
    levels = sum(len(r.levels) for r in aggregate.runs)
    return {**ctx, "digest": {"runs": runs, "levels": levels, "full": FULL,
                              "more_failures": max(0, len(failures) - LIST_ITEMS)},
            "verdicts": verdicts, "findings": findings, "scenarios": scenarios, "setup": setup, "planner": planner,
            "quality": quality, "cards": _cards(interpretation(aggregate)["kv_cards"], ranking),
            "warnings": _first(ctx["warnings"], "stability warnings"), "failures": failures[:LIST_ITEMS]}
