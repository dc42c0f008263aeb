"""Render one aggregate (the reference document's shape, plus kvexp's optional fields) as a report.

    render_report(aggregate, out_dir) -> {"md": .., "html": .., "pdf": .., "json": .., "csv": .., "charts": ..}

The charts are drawn by worker processes (charts.start_views) while the rest is made and comparison.json
and comparison.csv are written; a large report (is_large) charts each scenario's best runs and lays out
a digest as its PDF, naming where the full tables are.

Every number is formatted once, by the views (setup_view, scenario_view, planner_view, quality_view, with
kvexp.metrics.registry's formats), into plain-string tables (tables.Table); the Markdown and the HTML
templates lay out the same strings, so both show the same figures. The HTML is autoescaped (labels and
model names are user input); Markdown cells escape `|` and friends. The PDF is WeasyPrint's rendering of
the HTML; when WeasyPrint cannot load its system libraries the other files are still written and the
returned mapping records one line saying what to install.

Missing values follow registry.missing_text: "—"; "not exposed" for a figure a backend never reports;
"not recorded" for one another tool's file does not hold."""

from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from markupsafe import Markup

from kvexp.analysis import documents as D, findings as F, flags as FL
from kvexp.analysis.aggregate import interpretation
from kvexp.core.paths import atomic_write
from kvexp.metrics import registry
from kvexp.planning import recompute
from kvexp.report import charts as C, pdf
from kvexp.report.digest import digest
from kvexp.report.planner_view import planner_view
from kvexp.report.quality_view import card_view, quality_view
from kvexp.report.scenario_view import CHART_RUNS, scenario_views
from kvexp.report.setup_view import default_title, setup_view
from kvexp.report.tables import write_csv
from kvexp.report.templating import ReportError, environment, templates_dir
from kvexp.results.runs import Aggregate, Run
from kvexp.results.validate import validate_document

try:
    import orjson
except ImportError:  # pragma: no cover - orjson is optional (the `fast` extra)
    orjson = None

log = logging.getLogger(__name__)

FORMATS = ("md", "html", "pdf")
FILES = {"md": "report.md", "html": "report.html", "pdf": "report.pdf", "json": "comparison.json",
         "csv": "comparison.csv"}  # what render_report writes in its folder, by kind


class ReportFiles(dict):
    """What render_report wrote ({"md": Path, ...}); `problems` holds one line per step that was skipped."""

    def __init__(self) -> None:
        super().__init__()
        self.problems: list[str] = []


def _tail(text: Any, lines: int = 25, chars: int = 3000) -> str:
    s = "\n".join(str(text or "").rstrip().splitlines()[-lines:])
    return s[-chars:]


def _json_safe(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


def json_text(doc: Any) -> str:
    """A document as indented JSON, a number that is not finite as null: with orjson where it is installed
    (the `fast` extra; a 1,000-run aggregate in 0.1 s instead of 1 s), else json. The two write the same
    values; orjson writes some floats in other digits (0.000027 for 2.7e-05)."""
    if orjson is not None:
        try:
            return orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode() + "\n"
        except (TypeError, orjson.JSONEncodeError):  # (an integer beyond 64 bits, a type orjson does not know)
            pass
    return json.dumps(_json_safe(doc), indent=2, ensure_ascii=False) + "\n"


def colour_key(run: Run) -> str:
    """Runs that differ only by scenario share a colour: the label with the scenario token removed."""
    label, scen = run.label, str(run.scenario or "")
    if scen:
        stripped = re.sub(rf"(^|[-_.]){re.escape(scen)}(?=$|[-_.])", "", label).strip("-_.")
        if stripped:
            return stripped
    return label


_FINDING_GROUPS = (
    ("Problems", ("failed", "partial", "skipped", "failed_level")),
    ("Best configurations", ("best_overall_throughput", "best_overall_ttft_p95")),
    ("KV-cache dtype", ("kv_gain", "kv_slowdown")),
    ("KV dtype: capacity and speed against quality", ("quality_trade", "quality_nondeterministic")),
    ("Saturation and queueing", ("no_growth", "saturation")),
    ("Preemption", ("preemption", "no_preemption")),
    ("Caveats", ("kv_unconfirmed", "variable_length", "not_exposed")),
    ("Best per level", ("best_throughput", "best_ttft_p95")),
)


def skipped_runs(runs: list[Run]) -> list[dict[str, str]]:
    """The sweep's jobs that could not run (an unsupported backend x KV pair): label and reason."""
    return [{"label": r.label, "reason": D.first_line(r.status_reason) or "no reason recorded"}
            for r in runs if r.state == "skipped"]


def build_context(aggregate: Aggregate, title: Optional[str] = None, png_dir: Optional[Path] = None,
                  svg: bool = True) -> dict:
    """Everything the templates show, as plain strings, tables and rendered charts."""
    ctx, finish = start_context(aggregate, title, png_dir, svg)
    finish()
    return ctx


# A report of more levels than this (every level is a row of three tables) lays out for minutes as a
# PDF of every row: its PDF is a digest.
DIGEST_LEVELS = 500


def is_large(aggregate: Aggregate) -> bool:
    """A report with a scenario of more runs than its charts show (scenario_view.CHART_RUNS) or of more
    than DIGEST_LEVELS levels: its Markdown links the charts as SVG files (the HTML's drawing) and its
    PDF is a digest (report/digest.py); a large scenario's charts show its best runs."""
    levels = sum(len(r.levels) for r in aggregate.runs)
    return levels > DIGEST_LEVELS or any(len(runs) > CHART_RUNS for _, runs in aggregate.scenarios())


def start_context(aggregate: Aggregate, title: Optional[str] = None, png_dir: Optional[Path] = None,
                  svg: bool = True) -> tuple[dict, Callable[..., None]]:
    """build_context with its charts still being drawn (charts.start_views: in worker processes while
    this one goes on): (the context, the function that waits for the charts and puts them in it, or
    given True abandons them)."""
    if not isinstance(aggregate, Aggregate) or aggregate.present is not None and "runs" not in aggregate.present:
        raise ReportError("the aggregate has no runs list: expected the reference shape (gpu, runs[], ...)")
    runs = aggregate.runs
    keys = {r.label: colour_key(r) for r in runs}
    by_key = C.colour_map(keys.values())
    colours = {label: by_key[k] for label, k in keys.items()}
    warnings = FL.level_warnings(aggregate)
    # a large report's Markdown shows the charts as SVG files (the HTML's drawing), not a second drawing
    svg_files = png_dir is not None and is_large(aggregate)
    chart_png, chart_svg = (None, True) if svg_files else (png_dir, svg)
    scenarios = scenario_views(aggregate, colours, warnings, chart_png, chart_svg, svg_files)
    quality = quality_view(aggregate, colours, chart_png, chart_svg, svg_files)
    drawing = C.start_views([*scenarios, quality])  # every chart at once, while the rest is made
    try:  # (a failure here stops the drawing, as render_report's does)
        said = interpretation(aggregate)  # computed once, by collect, for an aggregate it made
        findings = F.compute_findings(replace(aggregate, kv_cards=said["kv_cards"]))
        groups = []
        checks = recompute.check_document(aggregate)
        if checks:
            groups.append({"name": "Planner predictions, recomputed by kvexp",
                           "sentences": [c.sentence for c in sorted(checks, key=lambda c: c.agrees is not False)]})
        for name, kinds in _FINDING_GROUPS:
            items = [f.sentence for f in findings if f.kind in kinds]
            if items:
                groups.append({"name": name, "sentences": items})
        failures = [{"label": r.label, "status": r.state, "scenario": str(r.scenario),
                     "reason": _tail(r.status_reason) or "no reason recorded"}
                    for r in runs if r.state in ("failed", "partial", "skipped")]
        ctx = {
            "verdicts": said["verdicts"],
            "skipped": skipped_runs(runs),
            "recommendations": [r["sentence"] for r in said["recommendations"]],
            "title": title or aggregate.title or default_title(aggregate),
            "rendered": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "kvexp_version": aggregate.kvexp_version or (aggregate.environment.kvexp_version
                                                         if aggregate.environment is not None else None),
            "findings": groups,
            "setup": setup_view(aggregate),
            "scenarios": scenarios,
            "planner": planner_view(aggregate),
            "quality": quality,
            "cards": card_view(Aggregate(kv_cards=said["kv_cards"])),
            "warnings": [w.message for w in warnings],
            "failures": failures,
            "not_exposed": registry.NOT_EXPOSED,
            "not_recorded": registry.NOT_RECORDED,
            "digest": None,  # the PDF of a large report: digest.digest's summary of the rest
        }
    except BaseException:
        drawing(True)
        raise

    def finish(abandon: bool = False) -> None:
        drawing(abandon)
        if svg_files and not abandon:
            C.save_svgs([*scenarios, quality], png_dir)  # type: ignore[arg-type]

    return ctx, finish


# ----------------------------------------------------------------------------------------------
# Files


def render_report(aggregate: Aggregate, out_dir: Path, title: Optional[str] = None,
                  formats: Iterable[str] = FORMATS, validated: bool = False) -> dict[str, Path]:
    """Write report.md (+ charts/*.png; *.svg in a large report), report.html (inline SVG), report.pdf (a
    digest in a large report: is_large, report/digest.py), comparison.json and comparison.csv into
    out_dir. Returns {"md", "html", "pdf", "json", "csv", "charts"} -> Path for what was written; a
    skipped PDF leaves a one-line message in the result's `problems`. validated: the aggregate is one
    collect just made (and checked against the schema), so it is not checked again."""
    formats = tuple(formats)
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ReportError(f"formats={list(formats)}: unknown {', '.join(unknown)}; "
                          f"allowed values are {', '.join(FORMATS)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = aggregate.to_json()
    if not validated:
        validate_document(doc, "aggregate")
    want_svg = "html" in formats or "pdf" in formats
    png_dir = out_dir / "charts" if "md" in formats else None
    ctx, charts_drawn = start_context(aggregate, title, png_dir, want_svg)
    files = ReportFiles()
    try:  # what needs no chart is written while the charts are drawn
        data = {"json": atomic_write(out_dir / FILES["json"], json_text(doc)),
                "csv": write_csv(aggregate, out_dir / FILES["csv"])}
    except BaseException:
        charts_drawn(True)
        raise
    charts_drawn()
    env = environment()
    if "md" in formats:
        files["md"] = atomic_write(out_dir / FILES["md"], env.get_template("report.md.j2").render(ctx))
        if png_dir is not None and png_dir.is_dir():
            files["charts"] = png_dir
    html = None
    if want_svg:
        css_path = templates_dir() / "report.css"
        ctx["css"] = Markup(css_path.read_text(encoding="utf-8")) if css_path.is_file() else ""
        html = env.get_template("report.html.j2").render(ctx)
        if "html" in formats:
            files["html"] = atomic_write(out_dir / FILES["html"], html)
    files.update(data)
    if "pdf" in formats and html is not None:
        if is_large(aggregate):  # a summary: the full tables are in the CSV and the HTML
            html = env.get_template("report.html.j2").render(digest(ctx, aggregate))
        try:
            files["pdf"] = pdf.write(html, out_dir / FILES["pdf"], out_dir)
        except pdf.PDFUnavailable as e:
            log.warning("%s", e)
            files.problems.append(str(e))
    return files
