"""Line charts for the comparison report.

matplotlib is used without pyplot (a bare `Figure` per chart, Agg/SVG canvases chosen by savefig), so
drawing holds no global state. Each chart is drawn once and saved as SVG text (inlined into the HTML
and the PDF) and/or a PNG file (beside the Markdown). Charts carry no per-run legend: one colour per run
label is fixed for the whole report and a single legend figure per scenario names them."""

from __future__ import annotations

import io
import logging
import math
import multiprocessing
import re
import threading
from concurrent.futures import BrokenExecutor, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import matplotlib as mpl
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, NullFormatter, NullLocator

from kvexp.backends import find
from kvexp.core import machine

log = logging.getLogger(__name__)

PALETTE = (
    # tab10, then the lighter halves of tab20, then tab20b: distinct first, similar only past 30 runs.
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
    "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7", "#dbdb8d", "#9edae5",
    "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#5254a3", "#8ca252", "#bd9e39", "#ad494a", "#a55194",
)


def marker(backend: Any) -> str:
    """A backend's chart marker (its adapter's chart_marker; a diamond for other tools' backends)."""
    adapter = find(backend)
    return adapter.chart_marker if adapter else "D"


MARKER_GLYPHS = {"o": "●", "s": "■", "^": "▲", "D": "◆"}  # the same shapes as text, for HTML legends
MAX_MARKED_SERIES = 16  # above this many lines a chart drops its markers (they cost more than they tell)
MAX_LABELLED_SERIES = 4  # above this many lines a chart labels each line's first and last point only
MAX_POINT_LABELS = 12  # a line of more points labels this many, evenly spread, its first and last among them
MAX_MARKED_POINTS = 64  # a line of more points than this is drawn without markers
FIG_SIZE = (4.6, 3.0)  # inches; three across a landscape A4 page
PNG_DPI = 110
_RC = {
    "font.size": 8, "axes.titlesize": 9, "axes.labelsize": 8, "xtick.labelsize": 7.5, "ytick.labelsize": 7.5,
    "legend.fontsize": 7, "svg.fonttype": "none", "axes.grid": True, "grid.alpha": 0.3,
    "axes.spines.top": False, "axes.spines.right": False,
}


@contextmanager
def _style(params: dict[str, Any]) -> Iterator[None]:
    """matplotlib's rc_context for a few settings: it copies and restores only those (rc_context copies
    every setting, a tenth of a small chart's drawing time)."""
    saved = {k: mpl.rcParams[k] for k in params}
    mpl.rcParams.update(params)
    try:
        yield
    finally:
        mpl.rcParams.update(saved)


@dataclass(frozen=True)
class Series:
    label: str
    colour: str
    xs: tuple[float, ...]
    ys: tuple[Optional[float], ...]
    marker: str = "o"
    linestyle: str = "-"
    point_labels: tuple[str, ...] = ()  # written beside each point ("c=4"), for charts whose x is not the level


@dataclass(frozen=True)
class ChartSpec:
    name: str  # file stem, unique in the report
    title: str
    xlabel: str
    ylabel: str
    series: tuple[Series, ...]
    logx: bool = False
    hlines: tuple[tuple[float, str], ...] = ()  # (y, what it is), drawn grey and named in the style key
    style_key: tuple[tuple[str, str], ...] = ()  # (linestyle, meaning), e.g. ("--", "planner prediction")
    logy: bool = False  # for latencies that span orders of magnitude
    legend: bool = False  # name the series in the chart (short names) instead of the scenario's shared legend
    data_ticks: bool = True  # x ticks at the data's x values (levels); False for a continuous x (latency)


@dataclass(frozen=True)
class Chart:
    name: str
    title: str
    svg: Optional[str] = None  # an <svg> element, ready to inline
    png: Optional[str] = None  # the image beside the Markdown, relative to the report folder (a PNG; an
    # SVG in a large report, save_svgs)


def colour_map(keys: Iterable[str]) -> dict[str, str]:
    """One colour per distinct key, in order of first appearance (cycling past the palette)."""
    out: dict[str, str] = {}
    for k in keys:
        if k not in out:
            out[k] = PALETTE[len(out) % len(PALETTE)]
    return out


def span_is_wide(xs: Iterable[float]) -> bool:
    """Log scale for x when the levels span more than 10x."""
    pos = [x for x in xs if x and x > 0]
    return bool(pos) and max(pos) / min(pos) > 10


def _text(s: str) -> str:
    return s.replace("$", r"\$")  # a "$" would start matplotlib's math mode


def scoped_ids(svg: str, scope: str) -> str:
    """matplotlib numbers every figure's ids from 1 ("text_14", "line2d_26"): several SVGs inline in one
    page would share them (an HTML error, and a WeasyPrint warning per id). Prefix each id, and each
    reference to one, with the chart's name."""
    svg = re.sub(r'\bid="([^"]+)"', lambda m: f'id="{scope}-{m.group(1)}"', svg)
    return re.sub(r'(href="|url\()#([^")]+)', lambda m: f"{m.group(1)}#{scope}-{m.group(2)}", svg)


_STYLED_TAG = re.compile(r'<([A-Za-z][\w:-]*)((?:\s[^<>]*?)?)\sstyle="([^"]*)"([^<>]*?)(/?)>')


def presentation_attributes(svg: str) -> str:
    """matplotlib writes an SVG element's look as a CSS `style` attribute (style="fill: none; stroke:
    ..."). WeasyPrint parses the style of every element of an inline SVG as HTML CSS, where `fill`,
    `stroke` and friends are unknown properties, and logs one warning per declaration (hundreds per
    report), though its SVG renderer then applies them. Written as SVG presentation attributes
    (fill="none" stroke="..."), they mean the same to every SVG renderer and nothing is ignored."""
    def one(m: re.Match) -> str:
        tag, before, style, after, close = m.groups()
        attrs = before + after
        for decl in style.split(";"):
            key, sep, value = decl.partition(":")
            key, value = key.strip(), value.strip()
            if not sep or not re.fullmatch(r"[a-z-]+", key):
                continue
            # a declaration in style wins over an attribute of the same name, as in CSS
            attrs = re.sub(rf'\s{key}="[^"]*"', "", attrs)
            attrs += f' {key}="{value}"'
        return f"<{tag}{attrs}{close}>"
    return _STYLED_TAG.sub(one, svg)


_BARE_GROUP = re.compile(r'\s*<g(?: id="[^"]*")?>\s*')
_GROUP_START = re.compile(r'\s*<g\b[^<>]*[^/<>]>\s*')


def lean(svg: str) -> str:
    """matplotlib's SVG without what draws nothing: its RDF metadata, and the <g id=...> wrapped around
    every artist (a group with no attribute but its id: nothing refers to it, and its children draw the
    same without it). Half the elements go, and with them much of WeasyPrint's time on a chart. matplotlib
    writes each group's tags on lines of their own; an SVG not written so is left as it is."""
    out: list[str] = []
    kept: list[bool] = []  # per open group: whether its tags are kept
    metadata = False
    for line in svg.split("\n"):
        tag = line.strip()
        if metadata or tag == "<metadata>":
            metadata = tag != "</metadata>"
            continue
        if _BARE_GROUP.fullmatch(line):
            kept.append(False)
            continue
        if _GROUP_START.fullmatch(line):
            kept.append(True)
        elif tag == "</g>":
            if not kept:
                return svg
            if not kept.pop():
                continue
        elif "<g" in line or "</g>" in line:
            return svg  # (a group's tag beside others: not matplotlib's layout)
        out.append(line)
    return "\n".join(out) if not kept and not metadata else svg


def _save(fig: Figure, name: str, out_dir: Optional[Path], rel_dir: str,
          svg: bool) -> tuple[Optional[str], Optional[str]]:
    svg_text = png_rel = None
    with _style({"svg.hashsalt": "kvexp", "svg.fonttype": "none"}):
        if svg:
            buf = io.StringIO()
            fig.savefig(buf, format="svg", metadata={"Date": None})
            text = buf.getvalue()
            svg_text = lean(presentation_attributes(scoped_ids(text[text.find("<svg"):], name)))
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            fig.savefig(out_dir / f"{name}.png", format="png", dpi=PNG_DPI)
            png_rel = f"{rel_dir}/{name}.png"
    return svg_text, png_rel


_CORNERS = ("upper right", "upper left", "lower left", "lower right")  # in matplotlib's order of preference


def _middle(p: tuple[float, float], q: tuple[float, float], spec: ChartSpec) -> tuple[float, float]:
    """The middle of a segment as drawn (on a log axis, the geometric mean)."""
    def mid(a: float, b: float, log: bool) -> float:
        return math.sqrt(a * b) if log and a > 0 and b > 0 else (a + b) / 2
    return mid(p[0], q[0], spec.logx), mid(p[1], q[1], spec.logy)


def _legend_corner(ax: Any, spec: ChartSpec, key: Sequence[Line2D]) -> str:
    """The corner whose legend box covers the fewest data points: matplotlib's loc="best" measures every
    line and label of the chart at nine places (half a chart's drawing time); the box's size is
    estimated from the entries (7-point text) and the points counted in axes coordinates."""
    pts: list[tuple[float, float]] = []
    for s in spec.series:
        line = [(x, y) for x, y in zip(s.xs, s.ys) if y is not None and not math.isnan(y)]
        pts += line + [_middle(p, q, spec) for p, q in zip(line, line[1:])]  # and what the lines cross
    if not pts:
        return _CORNERS[0]
    ax.get_xlim(), ax.get_ylim()  # (autoscale now: the transform reads the limits)
    frac = list(ax.transAxes.inverted().transform(ax.transData.transform(pts)))
    for y, _ in spec.hlines:  # a grey line across the chart
        fy = ax.transAxes.inverted().transform(ax.transData.transform([(pts[0][0], y)]))[0][1]
        frac += [(fx, fy) for fx in (0.02, 0.25, 0.5, 0.75, 0.98)]
    width = min(0.95, 0.1 + 0.0125 * max(len(h.get_label()) for h in key))
    height = min(0.95, 0.04 + 0.058 * len(key))
    counts = []
    for corner in _CORNERS:
        left, bottom = corner.endswith("left"), corner.startswith("lower")
        inside = sum(1 for fx, fy in frac if (fx <= width if left else fx >= 1 - width)
                     and (fy <= height if bottom else fy >= 1 - height))
        counts.append(inside)
    return _CORNERS[counts.index(min(counts))]


def labelled(points: int, lines: int) -> set[int]:
    """Which points of a line of `points` get their label in a chart of `lines` lines: every one, or
    (beyond MAX_LABELLED_SERIES lines) the first and last, or (beyond MAX_POINT_LABELS points)
    MAX_POINT_LABELS spread evenly from the first to the last: labels that overlap tell nothing."""
    if points <= 1:
        return set(range(points))
    if lines > MAX_LABELLED_SERIES:
        return {0, points - 1}
    if points <= MAX_POINT_LABELS:
        return set(range(points))
    return {round(i * (points - 1) / (MAX_POINT_LABELS - 1)) for i in range(MAX_POINT_LABELS)}


def render_chart(spec: ChartSpec, png_dir: Optional[Path], svg: bool = True, rel_dir: str = "charts") -> Chart:
    """Draw one chart; write `png_dir/<name>.png` when png_dir is given; return the SVG text when svg."""
    with _style(_RC):
        fig = Figure(figsize=FIG_SIZE)  # fixed margins: a layout engine costs more than the drawing
        fig.subplots_adjust(left=0.15, right=0.97, top=0.90, bottom=0.15)
        ax = fig.add_subplot()
        xs_all: set[float] = set()
        marked = len(spec.series) <= MAX_MARKED_SERIES
        for s in spec.series:
            pts = [(x, math.nan if y is None else y) for x, y in zip(s.xs, s.ys)]
            if not pts or all(math.isnan(y) for _, y in pts):
                continue
            xs_all.update(x for x, _ in pts)
            ax.plot([x for x, _ in pts], [y for _, y in pts], color=s.colour,
                    marker=s.marker if marked and len(pts) <= MAX_MARKED_POINTS else None,
                    markersize=3.5, linestyle=s.linestyle, linewidth=1.4, label=_text(s.label))
            shown = labelled(len(pts), len(spec.series))
            for i, ((x, y), text) in enumerate(zip(pts, s.point_labels)):
                if not math.isnan(y) and i in shown:
                    ax.annotate(_text(text), (x, y), textcoords="offset points", xytext=(3, 3), fontsize=6.5,
                                color=s.colour, annotation_clip=False)  # (its point is data: inside the axes)
        for y, _what in spec.hlines:
            ax.axhline(y, color="#555555", linestyle=":", linewidth=1)
        if spec.logx and xs_all and min(xs_all) > 0:
            ax.set_xscale("log", base=2 if spec.data_ticks else 10)
            ax.xaxis.set_minor_locator(NullLocator())
            ax.xaxis.set_minor_formatter(NullFormatter())
            if len(xs_all) <= 12 and spec.data_ticks:
                ax.set_xticks(sorted(xs_all))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _p: f"{v:g}"))
        elif len(xs_all) <= 12 and xs_all and spec.data_ticks:
            ax.set_xticks(sorted(xs_all))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _p: f"{v:g}"))
        if spec.logy:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _p: f"{v:g}"))
        else:
            ax.set_ylim(bottom=0)
        ax.set_title(_text(spec.title), y=1.0)  # a fixed place: no search of the ticks' boxes for room
        ax.set_xlabel(_text(spec.xlabel))
        ax.set_ylabel(_text(spec.ylabel))
        key = [Line2D([], [], color="#555555", linestyle=ls, linewidth=1.2, label=_text(what))
               for ls, what in spec.style_key]
        key += [Line2D([], [], color="#555555", linestyle=":", linewidth=1, label=_text(what))
                for _y, what in spec.hlines]
        if spec.legend:
            key += [Line2D([], [], color=s.colour, marker=s.marker, markersize=3.5, linewidth=1.4,
                           label=_text(s.label)) for s in spec.series]
        if key:
            ax.legend(handles=key, loc=_legend_corner(ax, spec, key), frameon=False)
        svg_text, png = _save(fig, spec.name, png_dir, rel_dir, svg)
    return Chart(spec.name, spec.title, svg_text, png)


def render_legend(name: str, entries: Sequence[tuple[str, str, str]], png_dir: Optional[Path], svg: bool = True,
                  rel_dir: str = "charts", columns: int = 4) -> Chart:
    """A legend strip: (label, colour, marker) per run, shared by every chart of a scenario."""
    ncol = max(1, min(columns, len(entries)))
    rows = math.ceil(len(entries) / ncol) if entries else 1
    with _style(_RC):
        fig = Figure(figsize=(11.0, 0.2 + 0.2 * rows))
        handles = [Line2D([], [], color=c, marker=m, markersize=4, linewidth=1.6, label=_text(lab))
                   for lab, c, m in entries]
        fig.legend(handles=handles, loc="center", ncol=ncol, frameon=False, fontsize=8, columnspacing=2.0)
        svg_text, png = _save(fig, name, png_dir, rel_dir, svg)
    return Chart(name, "Legend", svg_text, png)


# Below this many charts one process draws them sooner than a pool starts; above it, one process per CPU
# (up to MAX_WORKERS) draws them: matplotlib takes 0.1-0.3 s of one core per chart and format.
PARALLEL_MIN_CHARTS = 6
SPAWN_MIN_CHARTS = 24  # a spawned worker imports kvexp and matplotlib first (seconds): worth it for many only
MAX_WORKERS = 4


class Drawing:
    """Charts being drawn (start_all): result() waits for them, in order; abandon() stops what is left."""

    def __init__(self, tasks: Sequence[tuple[Any, tuple]], pool: Optional[ProcessPoolExecutor] = None) -> None:
        self.tasks, self.pool = tasks, pool
        self.futures = [pool.submit(fn, *args) for fn, args in tasks] if pool is not None else []

    def result(self) -> list[Chart]:
        if self.pool is None:
            return [fn(*args) for fn, args in self.tasks]
        try:
            return [f.result() for f in self.futures]  # a task's own error (a full disk) is raised as it is
        except BrokenExecutor as e:  # (a worker died: draw them here)
            log.warning("charts: drawing in one process (%s)", " ".join(str(e).split()))
            return [fn(*args) for fn, args in self.tasks]
        finally:
            self.pool.shutdown(cancel_futures=True)

    def abandon(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


def start_all(tasks: Sequence[tuple[Any, tuple]]) -> Drawing:
    """Start drawing each (render_chart or render_legend, its arguments). Many are drawn by worker
    processes, one per CPU (fork where this process holds no other thread, else spawn), while this
    process goes on with other work; few, or on one CPU, or when the pool cannot start, are drawn here
    when their result is asked for."""
    workers = min(machine.usable_cpus(), MAX_WORKERS, len(tasks))
    if workers < 2 or len(tasks) < PARALLEL_MIN_CHARTS:
        return Drawing(tasks)
    method = "fork" if threading.active_count() == 1 and "fork" in multiprocessing.get_all_start_methods() \
        else "spawn"  # (as kvexp.report.pdf starts its workers)
    if method == "spawn" and len(tasks) < SPAWN_MIN_CHARTS:
        return Drawing(tasks)
    try:
        return Drawing(tasks, ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context(method)))
    except (OSError, BrokenExecutor) as e:  # (a pool that cannot start: draw them here)
        log.warning("charts: drawing in one process (%s)", " ".join(str(e).split()))
        return Drawing(tasks)


def start_views(views: Sequence[Optional[dict]]) -> Callable[[bool], None]:
    """Start drawing the charts and legends the views hold as (function, arguments) (their "charts" list
    and "legend"), all at once (start_all); the function returned waits for them and puts each Chart in
    its place, or, given True, abandons them (the report failed before it needed them)."""
    views = [v for v in views if v]
    tasks = [t for v in views for t in [*v["charts"], *([v["legend"]] if v.get("legend") else [])]]
    drawing = start_all(tasks)

    def finish(abandon: bool = False) -> None:
        if abandon:
            drawing.abandon()
            return
        drawn = iter(drawing.result())
        for v in views:
            v["charts"] = [next(drawn) for _ in v["charts"]]
            v["legend"] = next(drawn) if v.get("legend") else None

    return finish


def save_svgs(views: Sequence[Optional[dict]], out_dir: Path, rel_dir: str = "charts") -> None:
    """Each drawn chart and legend of the views also as an SVG file beside the Markdown (a large report's
    Markdown shows these instead of PNGs: the same drawing as the HTML's, not a second one)."""
    out_dir.mkdir(parents=True, exist_ok=True)

    def saved(c: Optional[Chart]) -> Optional[Chart]:
        if c is None or c.svg is None:
            return c
        (out_dir / f"{c.name}.svg").write_text(c.svg, encoding="utf-8")
        return replace(c, png=f"{rel_dir}/{c.name}.svg")

    for v in views:
        if v:
            v["charts"] = [saved(c) for c in v["charts"]]
            v["legend"] = saved(v.get("legend"))
