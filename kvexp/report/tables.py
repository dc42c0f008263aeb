"""Plain-string tables and comparison.csv: the Table every view fills, Markdown tables, the level columns
of the report (each a key of kvexp.metrics.registry: its header is the metric's header, its cell the
registry's format, a null cell the registry's missing-value rule), and the CSV of every level."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from markupsafe import Markup, escape

from kvexp.analysis import documents as D, flags as FL
from kvexp.analysis.card import kv_cards
from kvexp.analysis.recommend import capacity, peak_level, slo_of, slo_outcome
from kvexp.analysis.verdict import bytes_per_token
from kvexp.metrics.levels import level_x
from kvexp.core.paths import atomic_write
from kvexp.metrics import registry
from kvexp.report.markdown import md_escape


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


def level_cell(run: dict, level: dict, key: str) -> str:
    """One level value as a table cell (registry.format_value); a null one by registry.missing_text."""
    repeat = key in _REPEAT_KEYS
    failed = level.get("status") == "failed" or D.run_status(run) in ("failed", "skipped")
    # whether another level has the figure matters only where this one has none (missing_text)
    exposed = True if not repeat and registry.level_value(level, key) is not None else D.exposes(run, key)
    return registry.level_text(level, key, failed=failed, exposed=exposed, foreign=bool(run.get("tool")),
                               value=FL.repeat_stats(level)[_REPEAT_KEYS[key]] if repeat else None, plain=repeat)


def level_name(level: dict[str, Any]) -> str:
    """A level as the summaries name it: its concurrency, or its rate as asked (and as achieved)."""
    if level.get("concurrency") is None and level.get("rate") is not None:
        achieved = level.get("achieved_rate")
        return f"{level['rate']:g} req/s" + (f" (achieved {achieved:g})" if achieved is not None else "")
    return registry.format_value("concurrency", level.get("concurrency"))


def peak_table(runs: list[dict], names: dict[str, str], first: str = "job") -> Table:
    """One row per run: its short name (names: label -> name), status, peak throughput and the level and
    latencies there, KV bytes per token, and, where some run set a latency objective, its outcome (the
    terminal's table at the end of a run, and a large report's PDF per scenario)."""
    rows = []
    slos = any(slo_of(r) for r in runs)
    for r in runs:
        peak = peak_level(r)
        bpt = bytes_per_token(r)
        slo = slo_of(r)
        outcome = ([slo_outcome(capacity(r, slo) if slo else None) if D.run_status(r) != "skipped" else "—"]
                   if slos else [])
        figures = ([registry.level_text(peak, "throughput_tok_s", failed=False, exposed=True), level_name(peak)]
                   + [registry.level_text(peak, k, failed=False, exposed=True) for k in ("ttft_p95_ms", "tpot_p50_ms")]
                   if peak else [registry.UNKNOWN] * 4)
        rows.append([str(r.get("label")), names[str(r.get("label"))], D.run_status(r), *figures,
                     registry.UNKNOWN if bpt is None else f"{bpt:,.0f}", *outcome])
    head = [first, "configuration", "status", "peak tok/s", "at", "TTFT p95 (ms)", "TPOT p50 (ms)", "KV B/token"]
    head += ["SLO"] if slos else []
    return Table(head, rows, [False] * 3 + [True] * 5 + [False] * slos)


def level_cells(rows: list[tuple[dict, dict]], key: str) -> list[str]:
    """level_cell of each (run, level) of a column, with what a run's rows share (its status, whether any
    of its levels has the figure) read once per run, not once per cell."""
    repeat = key in _REPEAT_KEYS
    exposed: dict[int, bool] = {}
    out = []
    for r, lv in rows:
        failed = lv.get("status") == "failed" or D.run_status(r) in ("failed", "skipped")
        value = FL.repeat_stats(lv)[_REPEAT_KEYS[key]] if repeat else None
        e = True
        if (value if repeat else registry.level_value(lv, key)) is None:  # (it matters only to a missing figure)
            e = exposed[id(r)] if id(r) in exposed else exposed.setdefault(id(r), D.exposes(r, key))
        out.append(registry.level_text(lv, key, failed=failed, exposed=e, foreign=bool(r.get("tool")),
                                       value=value, plain=repeat))
    return out


def tool_name(run: dict) -> str:
    """Which tool measured a run: kvexp, or the other benchmark tool (with its version) whose file it came from."""
    if not run.get("tool"):
        return "kvexp"
    return f"{run['tool']} {run['tool_version']}" if run.get("tool_version") else str(run["tool"])


# ----------------------------------------------------------------------------------------------
# comparison.csv: one row per run and level, the level keys as column names

# The run columns before the level keys ("tool" only when a run came from another tool's file).
CSV_RUN_COLUMNS = ("label", "tool", "backend", "model", "scenario", "kv_dtype", "kv_dtype_source", "run_status")
NESTED_LEVEL_BLOCKS = ("server", "delivery", "prefix_cache", "machine")  # a level's blocks whose figures get a column each


def _flat_keys(level: dict) -> list[str]:
    """A level's keys, with the figures of its NESTED_LEVEL_BLOCKS as dotted keys."""
    out = []
    for k, v in level.items():
        if k in NESTED_LEVEL_BLOCKS and isinstance(v, dict):
            out += [f"{k}.{inner}" for inner in v]
        else:
            out.append(k)
    return out


def _flat_level(level: dict) -> dict[str, Any]:
    """A level's values by _flat_keys' keys."""
    out: dict[str, Any] = {}
    for k, v in level.items():
        if k in NESTED_LEVEL_BLOCKS and isinstance(v, dict):
            out.update((f"{k}.{inner}", x) for inner, x in v.items())
        else:
            out[k] = v
    return out


def level_table(aggregate: dict) -> tuple[list[str], list[list[Any]]]:
    """comparison.csv as values: its column names and one row per run and level (None where missing).
    The level columns are the registry's keys in its order (those some level has, and ALWAYS), then
    any key the levels carry that the registry does not describe, sorted. A `tool` column (kvexp or the
    benchmark tool that measured the run) is there when a run came from another tool's file."""
    runs = list(aggregate.get("runs") or [])
    present = {k for r in runs for lv in r.get("levels") or [] for k in _flat_keys(lv)}
    level_keys = [k for k in registry.METRICS if k in present or k in ALWAYS] + sorted(present - set(registry.METRICS))
    tools = any(r.get("tool") for r in runs)
    cards = aggregate.get("kv_cards") if isinstance(aggregate.get("kv_cards"), list) else kv_cards(aggregate)
    card = {row["label"]: row for c in cards for row in c["rows"]}
    head = [c for c in CSV_RUN_COLUMNS if c != "tool" or tools] + level_keys + (list(CARD_COLUMNS) if card else [])
    rows = []
    for r in runs:
        kv = D.kv_name(r)
        base = [r.get("label"), *([tool_name(r)] if tools else []), r.get("backend"), r.get("model"),
                r.get("scenario"), kv.name, kv.source, D.run_status(r)]
        for lv in r.get("levels") or [{}]:
            flat = _flat_level(lv)  # (each nested block opened once per level, not once per column)
            rows.append(base + [flat[k] if k in flat else registry.level_value(lv, k) for k in level_keys]
                        + (_card_cells(card.get(str(r.get("label"))), lv) if card else []))
    return head, rows


# The KV-dtype card's figures for a run's row (kvexp/analysis/card.py): the changes at the row's own level.
CARD_COLUMNS = ("card_kv_bytes_per_token", "card_kv_window_bytes_per_sequence", "card_tokens_in_same_memory",
                "card_ttft_p50_change_pct", "card_ttft_beyond_noise", "card_tpot_p50_change_pct",
                "card_tpot_beyond_noise", "card_kld_mean", "card_kld_depth", "card_top1_agreement",
                "card_delta_ppl", "card_rotation")


def _card_cells(row: Any, level: dict) -> list[Any]:
    if not row:
        return [None] * len(CARD_COLUMNS)
    x = level_x(level)

    def at(key: str) -> tuple[Any, Any]:
        c = next((c for c in row[key] if x and (c["kind"], c["x"]) == x), None)
        return (c["change_pct"], c["beyond_noise"]) if c else (None, None)

    return [row["kv_bytes_per_token"], row["kv_window_bytes_per_sequence"], row["tokens_in_same_memory"],
            *at("ttft_change"), *at("tpot_change"), row["kld_mean"], row["depth"], row["top1_agreement"],
            row["delta_ppl"], row["rotation"]]


def csv_text(aggregate: dict) -> str:
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


def write_csv(aggregate: dict, path: Path) -> Path:
    """One row per run and level; runs without levels get one row with empty level columns."""
    return atomic_write(path, csv_text(aggregate))
