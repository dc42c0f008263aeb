"""The report's quality section: per run and context depth, the teacher-forced drift of its KV dtype
from the 16-bit KV baseline beside its KV capacity and its continuations' agreement, and a chart of
mean KLD against context depth."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from kvexp.analysis.card import CARD_HEADERS, card_rows, kv_cards
from kvexp.analysis.documents import backend_name
from kvexp.analysis.qualityfindings import fmt_kld, fmt_share
from kvexp.analysis.verdict import kv_key, kv_lookups, short_names
from kvexp.metrics.registry import format_value
from kvexp.report import charts as C
from kvexp.report.scenario_view import CHART_RUNS
from kvexp.report.tables import Table, drop_empty
from kvexp.results.blocks import QualityDepth
from kvexp.results.runs import Aggregate


def _memory_vs_drift(agg: Aggregate, colours: dict[str, str]) -> list[C.Series]:
    """Per backend and model: one point per KV dtype at (mean KLD at the deepest depth, KV bytes per
    token), labelled with the dtype: what a smaller KV dtype saves against what it costs."""
    mem, kld = kv_lookups(agg)
    groups: dict[tuple, dict[str, tuple[float, float]]] = {}
    for key, (mean_kld, _depth) in kld.items():
        if key in mem and key[2]:
            groups.setdefault(key[:2], {})[key[2]] = (mean_kld, mem[key])
    first = {}
    for r in agg.runs:
        first.setdefault(kv_key(r)[:2], r)
    names = len({m for _, m in groups}) > 1
    out = []
    for (backend, model), pts in groups.items():
        order = sorted(pts.items(), key=lambda kv: kv[1][1])
        label = backend_name(backend) + (f", {model.rsplit('/', 1)[-1]}" if names else "")
        out.append(C.Series(label, colours.get(first[(backend, model)].label, "#1f77b4"),
                            tuple(p[0] for _, p in order), tuple(p[1] for _, p in order), C.marker(backend),
                            point_labels=tuple(k for k, _ in order)))
    return out


def quality_view(agg: Aggregate, colours: dict[str, str], png_dir: Optional[Path], svg: bool,
                 svg_legend: bool = False) -> Optional[dict]:
    """The quality section: one row per run and context depth (teacher-forced drift from the 16-bit KV
    baseline, beside the run's KV capacity and its continuation agreement) and a chart of mean KLD
    against context depth; None when no run measured quality."""
    runs = [r for r in agg.runs if r.quality is not None]
    if not runs:
        return None
    headers = ["Run", "KV", "Baseline", "Depth", "Positions", "Mean KLD", "Median KLD", "p99 KLD", "Top-1 agree",
               "PPL base", "PPL", "ΔPPL", "KV capacity (tokens)", "Identical continuations", "First diff (mean)",
               "Prefix agree", "Baseline from"]
    rows, series, methods, notes = [], [], {}, []
    names = short_names(runs)
    drawn: dict[tuple, str] = {}  # a KV configuration's line, when there are more runs than a chart can tell apart
    one_each = len(runs) > CHART_RUNS
    for r in runs:
        q = r.quality
        if q is None:  # (runs holds none such)
            continue
        tf, cont, base = q.teacher_forced, q.continuation, q.baseline
        if tf.method:
            methods[tf.method] = tf.precision
        cap = r.kv_cache.capacity_tokens
        src = "cache" if base.cached else ("this job" if base.measured_by_this_job else "—")
        for d in tf.depths or [QualityDepth()]:
            rows.append([
                r.label, str(q.kv), str(base.kv),
                format_value("context", d.context), format_value("positions", d.positions),
                fmt_kld(d.kld_mean), fmt_kld(d.kld_median), fmt_kld(d.kld_p99),
                fmt_share(d.top1_agreement), format_value("ppl", d.ppl_base),
                format_value("ppl", d.ppl), format_value("delta_ppl", d.delta_ppl),
                format_value("capacity_tokens", cap), fmt_share(cont.identical_share),
                format_value("first_diff", cont.first_diff_mean), fmt_share(cont.prefix_agreement),
                src])
            if d.status and d.status != "ok":
                notes.append(f"{r.label}, depth {d.context}: {d.status}: {d.reason}")
        if tf.reason:
            notes.append(f"{r.label}: teacher-forced drift not measured: {tf.reason}")
        if cont.reason:
            notes.append(f"{r.label}: continuations: {cont.reason}")
        notes += [f"{r.label}: {w}" for w in q.warnings or []]
        pts = [(float(d.context), float(d.kld_mean))  # type: ignore[arg-type]
               for d in q.ok_depths if d.kld_mean > 0]  # type: ignore[operator]
        if q.kv == base.kv:  # the baseline against itself: the method's floor, in the table
            pts = []
        if pts and one_each and kv_key(r) in drawn:
            pts = []
        if pts:
            label = r.label
            drawn[kv_key(r)] = label
            name = short_names([r])[label] if one_each else names[label]
            series.append(C.Series(name, colours.get(label, "#1f77b4") if not one_each else
                                   C.PALETTE[(len(series)) % len(C.PALETTE)], tuple(x for x, _ in pts),
                                   tuple(y for _, y in pts), C.marker(r.backend)))
    ys = [y for s_ in series for y in s_.ys if y is not None]
    logy = bool(ys) and max(ys) / min(ys) > 20
    if series:
        notes.append("The chart shows the KV dtypes other than the baseline; the baseline against itself (the "
                     "method's floor) is in the table.")
    if one_each and series:
        notes.append(f"{len(runs)} runs measured quality: the chart draws one line per backend, model and KV "
                     "dtype (its first run's); the table holds every run.")
    charts = []
    if series:
        spec = C.ChartSpec("quality-kld", "Mean KLD from the 16-bit KV cache vs context depth",
                           "Context depth (tokens)", "Mean KLD (nats" + (", log scale)" if logy else ")"),
                           tuple(series), logx=True, logy=logy)
        charts.append((C.render_chart, (spec, png_dir, svg)))  # drawn with the others (charts.start_views)
    trade = _memory_vs_drift(agg, colours)
    if trade:
        charts.insert(0, (C.render_chart, (C.ChartSpec(
            "quality-memory", "KV memory per token vs drift, per KV dtype", "Mean KLD at the deepest depth (nats)",
            "KV cache bytes per token", tuple(trade), legend=True, data_ticks=False), png_dir, svg)))
    entries = [(s_.label, s_.colour, s_.marker) for s_ in series]
    legend = (C.render_legend, ("quality-legend", entries, png_dir, svg_legend)) \
        if entries and (png_dir is not None or svg_legend) else None
    table = Table(headers, rows, [False, False, False] + [True] * 13 + [False], kind="wide")
    return {"table": drop_empty(table, keep=4), "charts": charts, "notes": notes, "legend": legend,
            "legend_items": [{"label": lab, "colour": col, "glyph": C.MARKER_GLYPHS.get(m, "●")}
                             for lab, col, m in entries],
            "methods": [f"{m}: {p}" if p else m for m, p in methods.items()],
            "best": list(drawn.values()) if one_each else [r.label for r in runs]}


def card_view(agg: Aggregate) -> list[dict]:
    """The KV-dtype cards (kvexp/analysis/card.py): a title and a table each."""
    cards = agg.kv_cards if isinstance(agg.kv_cards, list) else kv_cards(agg)
    return [{"title": f"{backend_name(c['backend'])}, {c['model']} ({c['weights']}), scenario {c['scenario']}: "
                      f"each KV configuration against the {c['baseline']} cache",
             "table": Table(CARD_HEADERS, card_rows(c), [False, False, True, True, False, False, True, True, True],
                            kind="wide")} for c in cards]
