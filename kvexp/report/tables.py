"""Plain-string tables and comparison.csv: the Table every view fills, Markdown tables, the level columns
of the report (each a key of kvexp.metrics.registry: its header is the metric's header, its cell the
registry's format, a null cell the registry's missing-value rule), and the CSV of every level."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from markupsafe import Markup, escape

from kvexp.analysis import flags as FL
from kvexp.analysis.card import kv_cards
from kvexp.analysis.recommend import capacity, peak_level, slo_outcome
from kvexp.core.paths import atomic_write
from kvexp.metrics import registry
from kvexp.metrics.levels import Level
from kvexp.report.markdown import md_escape
from kvexp.results.runs import Aggregate, Run


@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]
    numeric: list[bool] = field(default_factory=list)
    kind: str = ""  # a CSS hook: "levels", "wide", ...
    widths: list[float] = field(default_factory=list)  # percent per column, from the text lengths

    def __post_init__(self) -> None:
        if not self.numeric:
            self.numeric = [False] * len(self.headers)
        if not self.widths:
            self.widths = column_widths(self.headers, self.rows)


def drop_empty(t: Table, keep: int = 1) -> Table:
    """The table without columns that are "—" in every row (the first `keep` columns stay)."""
    cols = [i for i in range(len(t.headers)) if i < keep or any(row[i] != registry.UNKNOWN for row in t.rows)]
    return Table([t.headers[i] for i in cols], [[row[i] for i in cols] for row in t.rows],
                 [t.numeric[i] for i in cols], t.kind)


def column_widths(headers: list[str], rows: list[list[str]], lo: int = 5, hi: int = 34) -> list[float]:
    """Relative column widths from the longest cell and the longest header word, so that the PDF can
    use a fixed table layout (WeasyPrint's automatic layout measures every cell: slow on long tables)."""
    chars = []
    for i, h in enumerate(headers):
        longest = max((len(r[i]) for r in rows if i < len(r)), default=0)
        word = max((len(w) for w in h.split()), default=0)
        chars.append(min(hi, max(lo, longest, word + 1)))
    total = sum(chars) or 1
    return [round(100 * c / total, 2) for c in chars]


def text_table(t: Table, rule: bool = True) -> list[str]:
    """The table as aligned plain-text lines for a terminal (numeric columns right-aligned), with a rule
    of dashes under the header."""
    widths = [max([len(h), *(len(row[i]) for row in t.rows)]) for i, h in enumerate(t.headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, t.numeric)).rstrip()

    return [line(t.headers), *([line(["-" * w for w in widths])] if rule else []), *(line(row) for row in t.rows)]


def md_table(t: Table, escape: bool = True) -> str:
    """The table in Markdown; escape=False for cells that are Markdown already (figures and **flags**)."""
    head = "| " + " | ".join(md_escape(h) for h in t.headers) + " |"
    rule = "|" + "|".join("---:" if n else "---" for n in t.numeric) + "|"
    body = ["| " + " | ".join(md_escape(c) if escape else " ".join(c.split()).replace("|", "\\|") for c in row)
            + " |" for row in t.rows]
    return "\n".join([head, rule, *body])


def html_table(t: Table) -> Markup:
    """The table as HTML, every cell escaped; a missing value's cell has the class "na". A template's
    loop wrote the same markup at a thousandth of the speed (three loop variables per cell)."""
    na = {registry.UNKNOWN, registry.NOT_EXPOSED, registry.NOT_RECORDED}
    cls = ["num" if n else "" for n in t.numeric]
    head = "".join(f'<th class="num">{escape(h)}</th>' if n else f"<th>{escape(h)}</th>"
                   for h, n in zip(t.headers, t.numeric))
    rows = "".join("<tr>" + "".join(f'<td class="{k}{" na" if c in na else ""}">{escape(c)}</td>'
                                    for c, k in zip(row, cls)) + "</tr>\n" for row in t.rows)
    cols = "".join(f'<col style="width: {w}%">' for w in t.widths)
    return Markup(f'<table class="{escape(t.kind)}">\n<colgroup>{cols}</colgroup>\n<thead><tr>{head}</tr></thead>\n'
                  f"<tbody>\n{rows}</tbody>\n</table>")


def uniq(xs: Iterable[Any]) -> list[Any]:
    """The values in order of first appearance, without None, "" and repeats."""
    out: list[Any] = []
    for x in xs:
        if x is not None and x != "" and x not in out:
            out.append(x)
    return out


# ----------------------------------------------------------------------------------------------
# Level columns: registry keys


def header(key: str) -> str:
    """A level column's header: the registry's ("TTFT p50 (ms)")."""
    return registry.metric(key).header


def numeric(key: str) -> bool:
    """Whether a level column holds numbers (right-aligned): every registered format but text."""
    return registry.metric(key).fmt != registry.Fmt.text


# The reference document's level columns, in its units (rate, achieved rate and repeat only when present).
LEVEL_COLUMNS = (
    "concurrency", "rate", "achieved_rate", "repeat", "requests", "errors", "throughput_tok_s", "ttft_p50_ms",
    "ttft_p95_ms",
    "prefix_cache.hit_rate",  # workloads that reuse prompts only
    "tpot_p50_ms", "peak_vram_gib", "peak_kv_cache_usage", "preemptions", "mean_prompt_tokens",
)
# Columns kvexp adds, in two tables; each column appears only when some level of the scenario has it.
LATENCY_COLUMNS = (
    "ttft_p99_ms", "tpot_p95_ms", "tpot_p99_ms", "itl_p50_ms", "itl_p95_ms", "itl_p99_ms", "e2e_p50_ms",
    "e2e_p95_ms", "e2e_p99_ms", "client_queue_p50_ms", "client_queue_p99_ms",
    # the server's own timing of the same requests, and how their tokens arrived
    "server.tpot_p50_ms", "server.tpot_mean_ms", "server.ttft_mean_ms", "server.queue_mean_ms",
    "delivery.tokens_per_chunk", "delivery.multi_token_chunk_share",
)
LOAD_COLUMNS = (
    "request_rate", "goodput_req_s", "mean_output_tokens", "wall_s", "max_running", "max_waiting",
    "peak_server_gpu_gib", "peak_rss_gib", "repeats", "throughput_ci95", "cv",
)
# The reference document's columns: shown (and in the CSV) even when no level has them.
ALWAYS = frozenset({"concurrency", "requests", "errors", "throughput_tok_s", "ttft_p50_ms", "ttft_p95_ms",
                    "tpot_p50_ms", "peak_vram_gib", "peak_kv_cache_usage", "preemptions", "mean_prompt_tokens"})
_REPEAT_KEYS = {"repeats": "n", "cv": "cv", "throughput_ci95": "ci95"}  # read from the level's repeat summary


def level_cell(run: Run, level: Level, key: str, exposes: Optional[Callable[[Run], bool]] = None) -> str:
    """One level value as a table cell (registry.format_value); a null one by registry.missing_text.
    exposes: Run.exposes for this key, where a caller holds it once per run (level_cells)."""
    repeat = key in _REPEAT_KEYS
    failed = level.failed or run.state in ("failed", "skipped")
    value = FL.repeat_stats(level)[_REPEAT_KEYS[key]] if repeat else level.value(key)
    # whether another level has the figure matters only where this one has none (missing_text)
    exposed = True if value is not None else (exposes(run) if exposes else run.exposes(key))
    return registry.level_text(level, key, failed=failed, exposed=exposed, foreign=bool(run.tool),
                               value=value if repeat else None, plain=repeat)


def level_name(level: Level) -> str:
    """A level as the summaries name it: its concurrency, or its rate as asked (and as achieved)."""
    if level.concurrency is None and level.rate is not None:
        achieved = level.achieved_rate
        return f"{level.rate:g} req/s" + (f" (achieved {achieved:g})" if achieved is not None else "")
    return registry.format_value("concurrency", level.concurrency)


def peak_table(runs: list[Run], names: dict[str, str], first: str = "job") -> Table:
    """One row per run: its short name (names: label -> name), status, peak throughput and the level and
    latencies there, KV bytes per token, and, where some run set a latency objective, its outcome (the
    terminal's table at the end of a run, and a large report's PDF per scenario)."""
    rows = []
    slos = any(r.objectives for r in runs)
    for r in runs:
        peak = peak_level(r)
        bpt = r.bytes_per_token
        slo = r.objectives
        outcome = ([slo_outcome(capacity(r, slo) if slo else None) if r.state != "skipped" else "—"]
                   if slos else [])
        figures = ([registry.level_text(peak, "throughput_tok_s", failed=False, exposed=True), level_name(peak)]
                   + [registry.level_text(peak, k, failed=False, exposed=True) for k in ("ttft_p95_ms", "tpot_p50_ms")]
                   if peak else [registry.UNKNOWN] * 4)
        rows.append([r.label, names[r.label], r.state, *figures,
                     registry.UNKNOWN if bpt is None else f"{bpt:,.0f}", *outcome])
    head = [first, "configuration", "status", "peak tok/s", "at", "TTFT p95 (ms)", "TPOT p50 (ms)", "KV B/token"]
    head += ["SLO"] if slos else []
    return Table(head, rows, [False] * 3 + [True] * 5 + [False] * slos)


def level_cells(rows: list[tuple[Run, Level]], key: str) -> list[str]:
    """level_cell of each (run, level) of a column, with whether a run's levels have the figure (it matters
    only to a missing one) read once per run, not once per cell."""
    exposed: dict[int, bool] = {}

    def exposes(run: Run) -> bool:
        if id(run) not in exposed:
            exposed[id(run)] = run.exposes(key)
        return exposed[id(run)]
    return [level_cell(r, lv, key, exposes) for r, lv in rows]


def tool_name(run: Run) -> str:
    """Which tool measured a run: kvexp, or the other benchmark tool (with its version) whose file it came from."""
    if not run.tool:
        return "kvexp"
    return f"{run.tool} {run.tool_version}" if run.tool_version else str(run.tool)


# ----------------------------------------------------------------------------------------------
# comparison.csv: one row per run and level, the level keys as column names

# The run columns before the level keys ("tool" only when a run came from another tool's file).
CSV_RUN_COLUMNS = ("label", "tool", "backend", "model", "scenario", "kv_dtype", "kv_dtype_source", "run_status")
NESTED_LEVEL_BLOCKS = ("server", "delivery", "prefix_cache", "machine")  # a level's blocks whose figures get a column each


def _flat_keys(level: Level) -> list[str]:
    """A level's keys (those its document holds), with the figures of its NESTED_LEVEL_BLOCKS as dotted keys."""
    out = []
    for k in level.keys():
        v = level.value(k)
        if k in NESTED_LEVEL_BLOCKS and isinstance(v, dict):
            out += [f"{k}.{inner}" for inner in v]
        else:
            out.append(k)
    return out


def _recorded(level: Level, keys: set[str], key: str) -> Any:
    """A level's figure by registry key as its document holds it (None where it does not)."""
    if key.partition(".")[0] not in keys:
        return None
    return [w.to_json() for w in level.warnings] if key == "warnings" else level.value(key)


def level_table(aggregate: Aggregate) -> tuple[list[str], list[list[Any]]]:
    """comparison.csv as values: its column names and one row per run and level (None where missing).
    The level columns are the registry's keys in its order (those some level has, and ALWAYS), then
    any key the levels carry that the registry does not describe, sorted. A `tool` column (kvexp or the
    benchmark tool that measured the run) is there when a run came from another tool's file."""
    runs = aggregate.runs
    present = {k for r in runs for lv in r.levels for k in _flat_keys(lv)}
    level_keys = [k for k in registry.METRICS if k in present or k in ALWAYS] + sorted(present - set(registry.METRICS))
    tools = any(r.tool for r in runs)
    cards = aggregate.kv_cards if isinstance(aggregate.kv_cards, list) else kv_cards(aggregate)
    card = {row["label"]: row for c in cards for row in c["rows"]}
    head = [c for c in CSV_RUN_COLUMNS if c != "tool" or tools] + level_keys + (list(CARD_COLUMNS) if card else [])
    rows = []
    for r in runs:
        kv = r.kv
        base = [r.label, *([tool_name(r)] if tools else []), r.backend, r.model,
                r.scenario, kv.name, kv.source, r.state]
        for lv in r.levels or [None]:
            keys = set(lv.keys()) if lv is not None else set()
            rows.append(base + [_recorded(lv, keys, k) if lv is not None else None for k in level_keys]
                        + (_card_cells(card.get(r.label), lv) if card else []))
    return head, rows


# The KV-dtype card's figures for a run's row (kvexp/analysis/card.py): the changes at the row's own level.
CARD_COLUMNS = ("card_kv_bytes_per_token", "card_kv_window_bytes_per_sequence", "card_tokens_in_same_memory",
                "card_ttft_p50_change_pct", "card_ttft_beyond_noise", "card_tpot_p50_change_pct",
                "card_tpot_beyond_noise", "card_kld_mean", "card_kld_depth", "card_top1_agreement",
                "card_delta_ppl", "card_rotation")


def _card_cells(row: Any, level: Optional[Level]) -> list[Any]:
    if not row:
        return [None] * len(CARD_COLUMNS)
    x = level.x if level is not None else None

    def at(key: str) -> tuple[Any, Any]:
        c = next((c for c in row[key] if x and (c["kind"], c["x"]) == x), None)
        return (c["change_pct"], c["beyond_noise"]) if c else (None, None)

    return [row["kv_bytes_per_token"], row["kv_window_bytes_per_sequence"], row["tokens_in_same_memory"],
            *at("ttft_change"), *at("tpot_change"), row["kld_mean"], row["depth"], row["top1_agreement"],
            row["delta_ppl"], row["rotation"]]


def csv_text(aggregate: Aggregate) -> str:
    """comparison.csv's text: level_table with empty cells for missing values; warnings as their codes
    ("few_requests; bursts"), a flat mapping as "key=value; ...", anything deeper as JSON."""
    head, rows = level_table(aggregate)

    def scalar(v: Any) -> bool:
        return v is None or isinstance(v, (str, int, float, bool))

    def cell(v: Any) -> Any:
        if v is None:
            return ""
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, list) and v and all(isinstance(w, dict) and "code" in w for w in v):
            return "; ".join(str(w["code"]) for w in v)
        if isinstance(v, dict) and all(scalar(x) for x in v.values()):
            return "; ".join(f"{k}={cell(x)}" for k, x in v.items())
        if isinstance(v, (list, dict)):
            return json.dumps(v, sort_keys=True)
        if isinstance(v, str) and v.lstrip(" ").startswith(FORMULA_STARTS):
            return "'" + v  # a spreadsheet opening the file would run it as a formula
        return v

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(head)
    for row in rows:
        w.writerow([cell(v) for v in row])
    return buf.getvalue()


FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")  # a text cell starting so is a formula to a spreadsheet


def write_csv(aggregate: Aggregate, path: Path) -> Path:
    """One row per run and level; runs without levels get one row with empty level columns."""
    return atomic_write(path, csv_text(aggregate))
