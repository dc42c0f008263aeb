"""The report's scenario sections: per scenario, the level table (every level as recorded, with its
warning codes), the latency and load detail tables, the workload's tables, and the charts with their
legend and notes. Every level column is a registry key (kvexp.report.tables)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Optional

from kvexp.analysis import documents as D, flags as FL, runplan as RP
from kvexp.analysis.recommend import ranked
from kvexp.analysis.verdict import short_names
from kvexp.metrics import registry
from kvexp.metrics.levels import Level
from kvexp.metrics.registry import format_value, is_num
from kvexp.report import charts as C
from kvexp.results.blocks import Workload
from kvexp.results.runs import Aggregate, Run
from kvexp.report.tables import (ALWAYS, LATENCY_COLUMNS, LEVEL_COLUMNS, LOAD_COLUMNS, Table, header, level_cell,
                                 level_cells, numeric, uniq)


# A scenario of more runs than this charts its best ones only (recommend.ranked): a chart of a hundred lines
# shows none of them, and each line costs drawing time; the tables keep every run.
CHART_RUNS = 10


def best_runs(runs: list[Run]) -> tuple[list[Run], list[Run]]:
    """(the runs a scenario's charts and a large report's PDF show: all, or the CHART_RUNS best; every run,
    best first where they are cut)."""
    if len(runs) <= CHART_RUNS:
        return runs, runs
    order = ranked(runs)
    return order[:CHART_RUNS], order


def _slug(s: str) -> str:
    """A file-name stem for a scenario's charts: 100 characters at most (a file name has 255 bytes)."""
    return re.sub(r"[^A-Za-z0-9]+", "-", s).strip("-").lower()[:100].rstrip("-") or "x"


def _level_tables(runs: list[Run], warn_codes: dict[tuple[int, int], list[str]], run_index: dict[int, int]
                  ) -> tuple[Table, list[tuple[str, Table]], list[str]]:
    """The scenario's level table (every level as recorded) and the detail tables, as strings."""
    rows: list[tuple[Run, int, Level]] = []
    for r in runs:
        levels = r.levels
        for li in sorted(range(len(levels)), key=lambda i: (levels[i].x or ("~", math.inf),
                                                            levels[i].repeat or 0)):
            rows.append((r, li, levels[li]))

    def columns(keys: tuple[str, ...], keep: set[str]) -> list[tuple[str, list[str]]]:
        out = []
        pairs = [(r, lv) for r, _, lv in rows]
        for k in keys:
            cells = level_cells(pairs, k)
            if k in keep or any(cell != registry.UNKNOWN for cell in cells):
                out.append((k, cells))
        return out

    has_conc = any(is_num(lv.concurrency) for _, _, lv in rows)
    reuse = any(_reuses(r) for r in runs)
    main_cols = columns(tuple(k for k in LEVEL_COLUMNS if reuse or not k.startswith("prefix_cache.")),
                        ALWAYS - (set() if has_conc or not rows else {"concurrency"}) | ({"prefix_cache.hit_rate"}
                                                                                         if reuse else set()))
    main_cols = [(k, cells) for k, cells in main_cols if k != "repeat" or any(x not in ("0", "—") for x in cells)]
    used: list[str] = []
    notes = []
    for r, li, _ in rows:
        codes = warn_codes.get((run_index[id(r)], li), [])
        used += [c for c in codes if c not in used]
        notes.append(", ".join(codes))
    body = [[r.label, r.kv.display, *(cells[n] for _, cells in main_cols), notes[n]]
            for n, (r, _, _) in enumerate(rows)]
    main = Table(["Run", "KV", *(header(k) for k, _ in main_cols), "Notes"], body,
                 [False, False, *(numeric(k) for k, _ in main_cols), False], kind="levels")
    if not any(notes):  # no warnings in this scenario: no Notes column (cells cost PDF time)
        main = Table(main.headers[:-1], [row[:-1] for row in main.rows], main.numeric[:-1], kind="levels")
    details = []
    for name, cols in (("Latency detail", LATENCY_COLUMNS), ("Load and memory detail", LOAD_COLUMNS)):
        dcols = columns(cols, set())
        if not dcols:
            continue
        where = [D.fmt_x(*lv.x) + (f" #{lv.repeat}" if (lv.repeat or 0) > 0 else "")
                 if lv.x else "—" for _, _, lv in rows]
        drows = [[r.label, where[n], *(cells[n] for _, cells in dcols)] for n, (r, _, _) in enumerate(rows)]
        details.append((name, Table(["Run", "Level", *(header(k) for k, _ in dcols)], drows,
                                    [False, True, *(numeric(k) for k, _ in dcols)], kind="levels")))
    return main, details + _workload_tables(rows), used


def _reuses(run: Run) -> bool:
    """The run's workload reuses prompts on purpose (shared prefixes, conversations, a dataset, a trace)."""
    return run.workload is not None and (run.workload.kind or "synthetic") != "synthetic"


def _lengths(s: Optional[dict]) -> str:
    return "—" if not s else f"{s['mean']:.0f} / {s['p50']:.0f} / {s['p99']:.0f}"


def _workload_tables(rows: list[tuple[Run, int, Level]]) -> list[tuple[str, Table]]:
    """The workload's shape beside what it measured: lengths asked and realised, the prefix cache and its
    reset per level; a histogram of realised prompt lengths per run; per-turn figures of conversations."""
    rows = [(r, li, lv) for r, li, lv in rows if lv.workload]
    if not rows:
        return []
    out = []
    body = []
    for r, _, lv in rows:
        w = lambda key: lv.value(f"workload.{key}")  # noqa: E731
        checked, arrival = w("prompts_checked") or 0, w("arrival_error_ms.p99")
        body.append([r.label, D.fmt_x(*lv.x) if lv.x else "—",
                     _lengths(w("prompt_tokens.asked")), _lengths(w("prompt_tokens.realised")),
                     _lengths(w("output_tokens.realised")),
                     f"{w('prompts_exact')}/{checked}" if checked else "—",
                     level_cell(r, lv, "prefix_cache.hit_rate"),
                     "—" if not lv.prefix_cache else
                     f"{lv.value('prefix_cache.hit_tokens'):,}/{lv.value('prefix_cache.queried_tokens'):,}",
                     "—" if lv.cache_reset is None else
                     ("yes" if lv.value("cache_reset.done") else "no") + f": {lv.value('cache_reset.how')}",
                     "—" if arrival is None else f"{arrival:.2f}"])
    cols = ["Run", "Level", "Prompt asked (mean/p50/p99)", "Prompt realised", "Output realised", "Exact prompts",
            header("prefix_cache.hit_rate"), "Hit / looked-up tokens", "Cache reset before", "Arrival error p99 (ms)"]
    keep = [i for i in range(len(cols)) if i < 2 or any(row[i] != "—" for row in body)]
    out.append(("Workload", Table([cols[i] for i in keep], [[row[i] for i in keep] for row in body],
                                  [False, True, *([False] * (len(keep) - 2))], kind="wide")))
    hist = []
    seen: set[str] = set()
    for r, _, lv in rows:  # one histogram per run: its first level's realised prompt lengths
        bins = lv.value("workload.prompt_histogram") or []
        if r.label in seen or not bins:
            continue
        seen.add(r.label)
        top = max(b["count"] for b in bins) or 1
        hist += [[r.label, f"{b['lo']}–{b['hi']}" if b["hi"] != b["lo"] else str(b["lo"]),
                  str(b["count"]), "█" * max(1 if b["count"] else 0, round(20 * b["count"] / top))] for b in bins]
    if hist:
        out.append(("Prompt lengths (realised, first level)",
                    Table(["Run", "Prompt tokens", "Requests", ""], hist, [False, True, True, False])))
    turns = [[r.label, D.fmt_x(*lv.x), str(t["turn"] + 1), str(t["requests"]),
              format_value("mean_prompt_tokens", t["mean_prompt_tokens"]),
              format_value("mean_prompt_tokens", t["mean_cached_tokens"]),
              format_value("ttft_p50_ms", t["ttft_p50_ms"])]
             for r, _, lv in rows for t in lv.turns or []]
    if turns:
        out.append(("Conversation turns", Table(["Run", "Level", "Turn", header("requests"),
                                                 header("mean_prompt_tokens"), "Mean cached tokens",
                                                 header("ttft_p50_ms")], turns,
                                                [False, True, True, True, True, True, True])))
    return out


def _workload_text(w: Workload) -> str:
    """The workload in a few words, for a scenario's description."""
    parts = [str(w.kind)]
    pd = w.prompt_dist
    if pd.varies:
        parts.append(f"prompt lengths {pd.kind} (mean {pd.mean:.0f})")
    if w.prefix_tokens:
        parts.append(f"{w.prefix_groups} shared prefix(es) of {w.prefix_tokens} tokens")
    if (w.turns or 1) > 1:
        parts.append(f"{w.turns} turns, think time {w.think_time_s:g} s")
    if w.dataset:
        parts.append(f"dataset {Path(w.dataset['file']).name}")
    if w.trace:
        parts.append(f"trace {Path(w.trace['file']).name} x{w.trace['time_scale']:g}")
    return "workload: " + ", ".join(parts)


def _series(runs: list[Run], xkind: str, key: str, colours: dict[str, str], scale: float = 1.0,
            linestyle: str = "-") -> list[C.Series]:
    out = []
    for r in runs:
        # a figure a warning disqualifies (registry.shown_value) is not drawn as if it were plain
        pts = [(lv.x[1], None if registry.shown_value(lv, key) else lv.number(key))  # type: ignore[index]
               for lv in r.merged_levels() if lv.x and lv.x[0] == xkind and r.usable(lv)]
        if any(y is not None for _, y in pts):
            out.append(C.Series(r.label, colours[r.label], tuple(x for x, _ in pts),
                                tuple(None if y is None else y * scale for _, y in pts),
                                C.marker(r.backend), linestyle))
    return out


def _pareto(runs: list[Run], xkind: str, latency: str, colours: dict[str, str]) -> list[C.Series]:
    """Throughput (y) against a latency percentile (x), one line per run through its levels, each point
    labelled with its level; a point whose latency a warning disqualifies (registry.shown_value) is left out."""
    names = short_names(runs)
    out = []
    for r in runs:
        pts = [(lv.number(latency), lv.number("throughput_tok_s"), lv.x[1])  # type: ignore[index]
               for lv in r.merged_levels() if lv.x and lv.x[0] == xkind and r.usable(lv)
               and registry.shown_value(lv, latency) is None]
        pts = [(x, y, lv) for x, y, lv in pts if x is not None and y is not None and x > 0]
        if pts:
            tag = "c=" if xkind == "concurrency" else ""
            unit = "" if xkind == "concurrency" else "/s"
            out.append(C.Series(names[r.label], colours[r.label], tuple(x for x, _, _ in pts),
                                tuple(y for _, y, _ in pts), C.marker(r.backend),
                                point_labels=tuple(f"{tag}{lv:g}{unit}" for _, _, lv in pts)))
    return out


def _wide_y(series: list[C.Series]) -> bool:
    ys = [y for s in series for y in s.ys if y is not None and y > 0]
    return bool(ys) and max(ys) / min(ys) > 50


def _chart_specs(scen: str, stem: str, runs: list[Run], xkind: str, colours: dict[str, str], agg: Aggregate,
                 plans: dict[str, Optional[RP.RunPlan]]) -> tuple[list[C.ChartSpec], list[str]]:
    xs = [lv.x[1] for r in runs for lv in r.levels if lv.x and lv.x[0] == xkind]
    logx = C.span_is_wide(xs)
    xlabel = "Concurrency (requests in flight)" if xkind == "concurrency" else "Request rate (requests/s)"
    stem = stem + ("" if xkind == "concurrency" else "-rate")
    specs: list[C.ChartSpec] = []
    notes: list[str] = []

    def add(name: str, title: str, ylabel: str, series: list[C.Series], **kw: Any) -> None:
        if series:
            specs.append(C.ChartSpec(f"{stem}-{name}", f"{scen}: {title}", xlabel, ylabel, tuple(series), logx, **kw))
        elif name != "kv":  # a KV chart without data is explained by the "not exposed" note below
            notes.append(f"{title}: no data.")

    for lat, what in (("ttft_p95_ms", "TTFT p95"), ("tpot_p95_ms", "TPOT p95")):
        pareto = _pareto(runs, xkind, lat, colours)
        if pareto:
            wide = C.span_is_wide(x for s_ in pareto for x in s_.xs)
            specs.append(C.ChartSpec(f"{stem}-pareto-{lat.split('_')[0]}", f"{scen}: throughput vs {what}",
                                     f"{what} (ms" + (", log scale)" if wide else ")"), "Throughput (tok/s)",
                                     tuple(pareto), logx=wide, legend=True, data_ticks=False))
    add("throughput", "throughput", "Throughput (tok/s)", _series(runs, xkind, "throughput_tok_s", colours))
    ttft = _series(runs, xkind, "ttft_p50_ms", colours) + _series(runs, xkind, "ttft_p95_ms", colours, linestyle=":")
    wide = _wide_y(ttft)
    add("ttft", "TTFT p50 and p95", "Time to first token (ms" + (", log scale)" if wide else ")"), ttft,
        style_key=(("-", "p50"), (":", "p95")), logy=wide)
    tpot = _series(runs, xkind, "tpot_p50_ms", colours) + _series(runs, xkind, "tpot_p95_ms", colours, linestyle=":")
    server = _series(runs, xkind, "server.tpot_p50_ms", colours, linestyle="--")
    styles = [(ls, what) for ls, what in (("-", "p50"), (":", "p95"), ("--", "server's own p50"))
              if any(s_.linestyle == ls for s_ in tpot + server)]
    add("tpot", "TPOT" + (" p50" if styles == [("-", "p50")] else ""), "Time per output token (ms)", tpot + server,
        style_key=tuple(styles) if len(styles) > 1 or server else ())
    mem = _series(runs, xkind, "peak_vram_gib", colours)
    rss = _series(runs, xkind, "peak_rss_gib", colours, linestyle="-.")
    gib = agg.gpu_gib
    add("memory", "peak memory", "Peak memory (GiB)", mem + rss,
        hlines=((float(gib), f"GPU memory {format_value('gpu_gib', gib)} GiB"),) if is_num(gib) and mem else (),
        style_key=((("-", "VRAM"), ("-.", "process RSS")) if rss and mem else ()))
    kv = _series(runs, xkind, "peak_kv_cache_usage", colours, scale=100)
    planned, calibrated, sources = [], [], []
    if xkind == "concurrency":
        for r in runs:
            plan = plans.get(r.label)
            if plan is None or r.state == "failed":
                continue
            for levels, dest, ls in ((plan.levels, planned, "--"), (plan.calibrated_levels, calibrated, "-.")):
                pts = [p for p in levels if p.predicted_kv_usage is not None]
                if pts:
                    dest.append(C.Series(r.label, colours[r.label], tuple(p.x for p in pts),
                                         tuple(p.predicted_kv_usage * 100 for p in pts),  # type: ignore[operator]
                                         C.marker(r.backend), ls))
                    sources.append(plan.source)
    hidden = [r.label for r in runs if r.levels and not r.exposes("peak_kv_cache_usage")]
    key = [("-", "measured")] if kv else []
    if planned:
        key.append(("--", "planner"))
    if calibrated:
        key.append(("-.", "planner, calibrated"))
    top = max((y for s in kv + planned + calibrated for y in s.ys if y is not None), default=0.0)
    add("kv", "KV-cache usage" + (" vs planner" if planned else ""), "KV-cache usage (%)", kv + planned + calibrated,
        hlines=((100.0, "KV capacity"),) if top >= 50 else (), style_key=tuple(key))
    if hidden:
        notes.append(f"KV-cache usage not exposed: {', '.join(hidden)}.")
    if planned and "calibration table" in sources:
        notes.append("Planner lines derived from the calibration table's inputs by kvexp's planner, assuming each "
                     "request holds prompt + max tokens.")
    return specs, notes


def scenario_views(agg: Aggregate, colours: dict[str, str], warnings: list[FL.Flag], png_dir: Optional[Path],
                   svg: bool, svg_legend: bool = False) -> list[dict]:
    """One section per scenario: its description, level and detail tables, warning codes and charts (each
    chart and legend still to draw: (function, arguments) for charts.start_views). svg_legend: the
    legend too as SVG (for a large report's Markdown, charts.save_svgs)."""
    runs_all = agg.runs
    run_index = {id(r): i for i, r in enumerate(runs_all)}
    warn_codes: dict[tuple[int, int], list[str]] = {}
    for w in warnings:
        codes = warn_codes.setdefault((w.run_index, w.level_index), [])
        if w.tag not in codes:
            codes.append(w.tag)
    plans = {r.label: RP.run_plan(r, agg) for r in runs_all}
    out = []
    stems: set[str] = set()
    for scen, runs in agg.scenarios():
        stem = _slug(scen)
        while stem in stems:  # two names with one slug ("a b", "a-b") must not share chart files
            stem += "-x"
        stems.add(stem)
        main, details, codes = _level_tables(runs, warn_codes, run_index)
        shown, order = best_runs(runs)
        cut = len(shown) < len(runs)
        # the best runs of a large scenario take the palette's first (most distinct) colours, best first
        tint = {r.label: C.PALETTE[i] for i, r in enumerate(shown)} if cut else colours
        kinds = uniq(lv.x[0] for r in shown for lv in r.merged_levels() if lv.x)
        charts, notes = [], []
        if cut:
            notes.append(f"The charts show the {len(shown)} best of this scenario's {len(runs)} runs (by capacity "
                         "within the latency objective where one was set, else by peak throughput); the tables "
                         "and comparison.csv hold every run.")
        for xkind in kinds:
            specs, n = _chart_specs(scen, stem, shown, xkind, tint, agg, plans)
            notes += n
            charts += [(C.render_chart, (s, png_dir, svg)) for s in specs]  # drawn below, all at once
        names = short_names(shown)  # backend + KV dtype (+ model where it varies), not job ids
        entries = [(names[r.label], tint[r.label], C.marker(r.backend))
                   for r in shown if any(r.usable(lv) for lv in r.levels)]
        # The legend: a PNG beside the Markdown; in HTML a list of coloured glyphs (cheaper than an SVG).
        legend = (C.render_legend, (f"{stem}-legend", entries, png_dir, svg_legend)) \
            if entries and charts and (png_dir is not None or svg_legend) else None
        legend_items = [{"label": lab, "colour": col, "glyph": C.MARKER_GLYPHS.get(m, "●")}
                        for lab, col, m in entries] if charts else []
        # a trace's or a dataset's own lengths, not the scenario's, are what was sent
        own = [r for r in runs if r.workload is None or r.workload.kind not in ("trace", "dataset")]
        prompt = uniq(r.prompt_tokens for r in own)
        maxt = uniq(r.max_tokens for r in own)
        desc = []
        if prompt:
            desc.append(f"prompt {', '.join(map(str, prompt))} tokens")
        if maxt:
            desc.append(f"up to {', '.join(map(str, maxt))} output tokens")
        desc += uniq(_workload_text(r.workload) for r in runs
                     if r.workload is not None and (_reuses(r) or r.workload.prompt_dist.varies))
        ran = [r for r in runs if r.state != "skipped"]  # a skipped job is no run: it is listed apart
        desc.append(f"{len(ran)} run{'s' if len(ran) != 1 else ''}" + (f", {len(runs) - len(ran)} skipped"
                                                                      if len(ran) < len(runs) else ""))
        failed = [{"label": r.label, "status": r.state,
                   "reason": D.first_line(r.status_reason) or "no reason recorded"}
                  for r in runs if r.state in ("failed", "partial", "skipped")]
        out.append({
            "name": scen, "anchor": stem, "description": "; ".join(desc), "table": main, "details": details,
            "codes": [(c, FL.WARNING_CODES.get(c, c)) for c in codes],
            "kv_label_note": any(r.kv.source == "label" for r in runs), "charts": charts, "legend": legend,
            "legend_items": legend_items,
            "notes": notes, "failed": failed, "best": [r.label for r in shown], "run_count": len(runs),
            "ranking": [r.label for r in order],
        })
    return out

