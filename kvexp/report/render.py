"""Render one aggregate (the reference document's shape, plus kvexp's optional fields) as a report.

    render_report(aggregate, out_dir) -> {"md": .., "html": .., "pdf": .., "json": .., "csv": .., "charts": ..}

Every number is formatted once, here (with kvexp.analysis.findings.format_value), into plain-string tables; the
Markdown and the HTML templates lay out the same strings, so both show the same figures. The HTML is
autoescaped (labels and model names are user input); Markdown cells escape `|` and friends. The PDF is
WeasyPrint's rendering of the HTML; when WeasyPrint cannot load its system libraries the other files are
still written and the returned mapping records one line saying what to install.

Missing values show as "—"; KV usage and preemptions that a run never reports show as "not exposed"."""

from __future__ import annotations

import csv
import datetime as _dt
import io
import json
import logging
import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from jinja2 import Environment, FileSystemLoader, StrictUndefined
from markupsafe import Markup

from kvexp.report import charts as C
from kvexp.analysis import findings as F
from kvexp import backends
from kvexp.report import pdf
from kvexp.planning import recompute, whatif
from kvexp.report.markdown import md_code, md_escape
from kvexp.core.paths import atomic_write, data_dir
from kvexp.capacity.planner import kv_bytes_per_token

log = logging.getLogger(__name__)

FORMATS = ("md", "html", "pdf")
NOT_EXPOSED = "not exposed"
NOT_RECORDED = "not recorded"  # a figure another benchmark tool's file does not hold


class ReportError(RuntimeError):
    """The report cannot be rendered; the message is one line."""


class ReportFiles(dict):
    """What render_report wrote ({"md": Path, ...}); `problems` holds one line per step that was skipped."""

    def __init__(self) -> None:
        super().__init__()
        self.problems: list[str] = []


@dataclass(frozen=True)
class Column:
    key: str
    header: str
    numeric: bool = True


# The reference document's level columns, in its units (rate, achieved rate and repeat only when present).
LEVEL_COLUMNS = (
    Column("concurrency", "Concurrency"),
    Column("rate", "Rate (req/s)"),
    Column("achieved_rate", "Achieved (req/s)"),
    Column("repeat", "Repeat"),
    Column("requests", "Requests"),
    Column("errors", "Errors"),
    Column("throughput_tok_s", "Throughput (tok/s)"),
    Column("ttft_p50_ms", "TTFT p50 (ms)"),
    Column("ttft_p95_ms", "TTFT p95 (ms)"),
    Column("prefix_cache.hit_rate", "Prefix-cache hits (%)"),  # workloads that reuse prompts only
    Column("tpot_p50_ms", "TPOT p50 (ms)"),
    Column("peak_vram_gib", "Peak VRAM (GiB)"),
    Column("peak_kv_cache_usage", "Peak KV usage (%)"),
    Column("preemptions", "Preemptions"),
    Column("mean_prompt_tokens", "Mean prompt tokens"),
)
# Columns kvexp adds, in two tables; each column appears only when some level of the scenario has it.
LATENCY_COLUMNS = (
    Column("ttft_p99_ms", "TTFT p99 (ms)"),
    Column("tpot_p95_ms", "TPOT p95 (ms)"),
    Column("tpot_p99_ms", "TPOT p99 (ms)"),
    Column("itl_p50_ms", "ITL p50 (ms)"),
    Column("itl_p95_ms", "ITL p95 (ms)"),
    Column("itl_p99_ms", "ITL p99 (ms)"),
    Column("e2e_p50_ms", "E2E p50 (ms)"),
    Column("e2e_p95_ms", "E2E p95 (ms)"),
    Column("e2e_p99_ms", "E2E p99 (ms)"),
    Column("client_queue_p50_ms", "Client queue p50 (ms)"),
    Column("client_queue_p99_ms", "Client queue p99 (ms)"),
    # the server's own timing of the same requests, and how their tokens arrived
    Column("server.tpot_p50_ms", "Server TPOT p50 (ms)"),
    Column("server.tpot_mean_ms", "Server TPOT mean (ms)"),
    Column("server.ttft_mean_ms", "Server TTFT mean (ms)"),
    Column("server.queue_mean_ms", "Server queue mean (ms)"),
    Column("delivery.tokens_per_chunk", "Tokens per chunk"),
    Column("delivery.multi_token_chunk_share", "Multi-token chunks (%)"),
)
LOAD_COLUMNS = (
    Column("request_rate", "Request rate (req/s)"),
    Column("goodput_req_s", "Goodput (req/s)"),
    Column("mean_output_tokens", "Mean output tokens"),
    Column("wall_s", "Wall (s)"),
    Column("max_running", "Max running"),
    Column("max_waiting", "Max waiting"),
    Column("peak_server_gpu_gib", "Server GPU (GiB)"),
    Column("peak_rss_gib", "Peak RSS (GiB)"),
    Column("repeats", "Repeats"),
    Column("throughput_ci95", "Throughput CI95 (tok/s)", numeric=False),
    Column("cv", "Throughput CV (%)"),
)
_REPEAT_KEYS = {"repeats": "n", "cv": "cv", "throughput_ci95": "ci95"}
_ALWAYS = {"concurrency", "requests", "errors", "throughput_tok_s", "ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms",
           "peak_vram_gib", "peak_kv_cache_usage", "preemptions", "mean_prompt_tokens"}
# CSV column order: the reference's level keys, then kvexp's, then anything else found.
CSV_LEVEL_KEYS = (
    "concurrency", "rate", "achieved_rate", "repeat", "requests", "errors", "throughput_tok_s", "ttft_p50_ms",
    "ttft_p95_ms",
    "ttft_p99_ms", "tpot_p50_ms", "tpot_p95_ms", "tpot_p99_ms", "itl_p50_ms", "itl_p95_ms", "itl_p99_ms",
    "e2e_p50_ms", "e2e_p95_ms", "e2e_p99_ms", "peak_vram_gib", "peak_rss_gib", "peak_kv_cache_usage",
    "preemptions", "mean_prompt_tokens", "mean_output_tokens", "goodput_req_s", "wall_s", "status",
    "client_limited", "repeats", "throughput_ci95", "cv", "warnings",
)


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
    cols = [i for i in range(len(t.headers)) if i < keep or any(row[i] != "—" for row in t.rows)]
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


# ----------------------------------------------------------------------------------------------
# Small helpers


def templates_dir() -> Path:
    """The report templates (paths.data_dir: the checkout's templates/, else the wheel's package data)."""
    try:
        return data_dir("templates")
    except FileNotFoundError as e:
        raise ReportError(str(e)) from None


def md_table(t: Table) -> str:
    head = "| " + " | ".join(md_escape(h) for h in t.headers) + " |"
    rule = "|" + "|".join("---:" if n else "---" for n in t.numeric) + "|"
    body = ["| " + " | ".join(md_escape(c) for c in row) + " |" for row in t.rows]
    return "\n".join([head, rule, *body])


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", s).strip("-").lower() or "x"


def _short_model(model: Any) -> str:
    s = str(model or "—")
    return s.rsplit("/", 1)[-1] if s.startswith(("/", ".")) else s


def _uniq(xs: Iterable[Any]) -> list[Any]:
    out: list[Any] = []
    for x in xs:
        if x is not None and x != "" and x not in out:
            out.append(x)
    return out


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


def _gib(v: Any) -> Optional[float]:
    return v / 2**30 if F.is_num(v) else None


def level_cell(run: dict, level: dict, key: str) -> str:
    """One level value as a table cell: "—" when missing, "not exposed" for KV figures a run never reports."""
    v = F.repeat_stats(level)[_REPEAT_KEYS[key]] if key in _REPEAT_KEYS else F.level_value(level, key)
    if key == "repeats" and F.is_num(v):
        return F.format_value("n", v)
    failed = level.get("status") == "failed" or F.run_status(run) in ("failed", "skipped")
    if v is None and key in F.EXPOSURE_KEYS and not failed and not F.exposes(run, key):
        return NOT_RECORDED if run.get("tool") else NOT_EXPOSED
    return F.format_value(key, v)


def device_text(aggregate: dict) -> Optional[str]:
    """The GPU(s) of the runs; "CPU only: <model>" when no run had a GPU and the environment names the
    CPU; None when neither is known."""
    gpus = _uniq([aggregate.get("gpu"), *(r.get("gpu") for r in aggregate.get("runs") or [])])
    if gpus:
        return ", ".join(map(str, gpus))
    cpu = (aggregate.get("environment") or {}).get("cpu") if isinstance(aggregate.get("environment"), dict) else None
    return f"CPU only: {cpu}" if cpu else None


def default_title(aggregate: dict) -> str:
    gpu = device_text(aggregate) or "unknown GPU"
    models = _uniq(_short_model(r.get("model")) for r in aggregate.get("runs") or [])
    what = ", ".join(models) if 0 < len(models) <= 3 else f"{len(models)} models" if models else "no runs"
    return f"kvexp comparison — {gpu} — {what}"


# ----------------------------------------------------------------------------------------------
# The view: every string the templates show


def _colour_key(run: dict) -> str:
    """Runs that differ only by scenario share a colour: the label with the scenario token removed."""
    label, scen = str(run.get("label")), str(run.get("scenario") or "")
    if scen:
        stripped = re.sub(rf"(^|[-_.]){re.escape(scen)}(?=$|[-_.])", "", label).strip("-_.")
        if stripped:
            return stripped
    return label


def _kv_capacity(kv: dict) -> Optional[float]:
    if F.is_num(kv.get("capacity_tokens")):
        return float(kv["capacity_tokens"])
    if F.is_num(kv.get("blocks")) and F.is_num(kv.get("block_size")):
        return float(kv["blocks"] * kv["block_size"])
    return None


def _output_length(run: dict) -> str:
    flag = run.get("variable_length")
    if flag is True:
        return "capped"
    if flag is False:
        return "forced"
    return "capped (assumed)" if F.caps_output_only(run) else "—"


def _setup_view(agg: dict) -> dict:
    runs = list(agg.get("runs") or [])
    facts: list[tuple[str, str]] = []
    gib = agg.get("gpu_gib")
    facts.append(("GPU", device_text(agg) or "—"))
    facts.append(("GPU memory", f"{F.format_value('gpu_gib', gib)} GiB" if F.is_num(gib) else "—"))
    facts.append(("Models", ", ".join(map(str, _uniq(r.get("model") for r in runs))) or "—"))
    backends = _uniq(r.get("backend") for r in runs)
    facts.append(("Backends", ", ".join(F.backend_name(b) for b in backends) or "—"))
    dates = sorted(_uniq([*(agg.get("run_dates") or []), *(r.get("started_at") for r in runs)]), key=str)
    if dates:
        facts.append(("Run dates", str(dates[0]) if len(dates) == 1 else f"{dates[0]} … {dates[-1]}"))
    for key, name in (("kvexp_version", "kvexp version"), ("schema_version", "Schema version")):
        if agg.get(key) is not None:
            facts.append((name, str(agg[key])))

    env_table = None
    env = agg.get("environment")
    if isinstance(env, dict) and env:
        env_table = Table(["Key", "Value"], [[str(k), v if isinstance(v, str) else json.dumps(v, sort_keys=True)]
                                             for k, v in env.items()], kind="kv")

    backend_rows = []
    for b in backends:
        br = [r for r in runs if r.get("backend") == b]
        versions = ", ".join(map(str, _uniq(r.get("backend_version") for r in br)))
        backend_rows.append([F.backend_name(b), versions or "—", str(len(br))])
    backend_table = Table(["Backend", "Version", "Runs"], backend_rows, [False, False, True])

    run_rows = []
    any_tool = any(r.get("tool") for r in runs)
    for r in runs:
        kv = F.kv_name(r)
        reused = r.get("reused_server")
        run_rows.append([
            str(r.get("label")), tool_name(r) if any_tool else "—", F.backend_name(r.get("backend")),
            str(r.get("backend_version") or "—"),
            str(r.get("model") or "—"), F.weights_display(r), str(r.get("scenario") or "—"), kv.display,
            _output_length(r),
            F.run_status(r), str(r.get("started_at") or "—"),
            "—" if reused is None else ("reused" if reused else "launched"),
        ])
    run_table = drop_empty(Table(["Run", "Measured by", "Backend", "Version", "Model", "Weights", "Scenario", "KV",
                                  "Output length", "Status", "Started", "Server"], run_rows, kind="wide"))

    kv_rows = []
    for r in runs:
        kv = r.get("kv_cache") or {}
        k, v = kv.get("dtype_k"), kv.get("dtype_v")
        src = kv.get("source")
        kv_rows.append([
            str(r.get("label")), str(r.get("kv_requested") or "—"), F.format_value("dtype", kv.get("dtype")),
            "—" if not (k or v) else f"{k or '—'} / {v or '—'}",
            F.format_value("blocks", kv.get("blocks")), F.format_value("block_size", kv.get("block_size")),
            F.format_value("capacity_tokens", _kv_capacity(kv)),
            F.format_value("kv_gib", _gib(kv.get("bytes"))),
            F.format_value("gpu_memory_utilization", kv.get("gpu_memory_utilization")),
            F.format_value("max_concurrency", kv.get("max_concurrency")),
            ", ".join(map(str, src)) if isinstance(src, list) else F.format_value("source", src),
        ])
    # Runs whose server reported nothing about its KV cache are named in one line, not a row of dashes.
    kv_unreported = [row[0] + (f" (requested {row[1]})" if row[1] != "—" else "") for row in kv_rows
                     if all(c == "—" for c in row[2:])]
    kv_rows = [row for row in kv_rows if not all(c == "—" for c in row[2:])]
    kv_table = drop_empty(Table(["Run", "Requested", "Dtype", "K / V", "Blocks", "Block size", "Capacity (tokens)",
                      "KV memory (GiB)", "GPU mem. util. (%)", "Max concurrency", "Source"], kv_rows,
                     [False, False, False, False, True, True, True, True, True, True, False], kind="wide")) \
        if kv_rows else None

    scen_rows = []
    for scen, sruns in F.scenarios(agg):
        xs: dict[str, set[float]] = {}
        for r in sruns:
            for lv in r.get("levels") or []:
                x = F.level_x(lv)
                if x:
                    xs.setdefault(x[0], set()).add(x[1])
        levels = "; ".join(f"{F.x_words(k)} {', '.join(F.format_value(k, x) for x in sorted(v))}"
                           for k, v in sorted(xs.items())) or "—"
        prompts = ", ".join(F.format_value("prompt_tokens", p) for p in _uniq(r.get("prompt_tokens") for r in sruns))
        maxes = ", ".join(F.format_value("max_tokens", p) for p in _uniq(r.get("max_tokens") for r in sruns))
        scen_rows.append([scen, prompts or "—", maxes or "—", levels, str(len(sruns))])
    scen_table = Table(["Scenario", "Prompt tokens", "Max tokens", "Levels", "Runs"], scen_rows,
                       [False, True, True, False, True])

    launches = []
    for r in runs:
        cmd = r.get("launch_command")
        if cmd:
            text = shlex.join(map(str, cmd)) if isinstance(cmd, list) else str(cmd)
            launches.append({"label": str(r.get("label")), "command": text,
                             "reused": bool(r.get("reused_server"))})
    return {"facts": facts, "environment": env_table, "backends": backend_table, "runs": run_table,
            "foreign": _foreign_view(runs),
            "kv": kv_table, "kv_unreported": kv_unreported, "scenarios": scen_table, "launches": launches,
            "kv_label_note": any(F.kv_name(r).source == "label" for r in runs)}


def tool_name(run: dict) -> str:
    """Which tool measured a run: kvexp, or the other benchmark tool (with its version) whose file it came from."""
    if not run.get("tool"):
        return "kvexp"
    return f"{run['tool']} {run['tool_version']}" if run.get("tool_version") else str(run["tool"])


def _foreign_view(runs: list[dict]) -> list[dict]:
    """Per tool: its runs, their files, what it does not record and how its definitions differ."""
    out: dict[str, dict] = {}
    for r in runs:
        if not r.get("tool"):
            continue
        t = out.setdefault(str(r["tool"]), {"tool": str(r["tool"]), "rows": [], "notes": [], "not_recorded": []})
        t["rows"].append([str(r.get("label")), tool_name(r), str(r.get("source") or "—")])
        t["notes"] += [n for n in r.get("tool_notes") or [] if n not in t["notes"]]
        t["not_recorded"] += [k for k in r.get("not_recorded") or [] if k not in t["not_recorded"]]
    for t in out.values():
        t["table"] = Table(["Run", "Tool", "Files"], t.pop("rows"), kind="wide")
        t["not_recorded"] = ", ".join(t["not_recorded"])
    return list(out.values())


def _level_tables(runs: list[dict], warn_codes: dict[tuple[int, int], list[str]], run_index: dict[int, int]
                  ) -> tuple[Table, list[tuple[str, Table]], list[str]]:
    """The scenario's level table (every level as recorded) and the detail tables, as strings."""
    rows: list[tuple[dict, int, dict]] = []
    for r in runs:
        levels = r.get("levels") or []
        for li in sorted(range(len(levels)), key=lambda i: (F.level_x(levels[i]) or ("~", math.inf),
                                                            levels[i].get("repeat") or 0)):
            rows.append((r, li, levels[li]))

    def columns(cols: tuple[Column, ...], keep: set[str]) -> list[tuple[Column, list[str]]]:
        out = []
        for c in cols:
            cells = [level_cell(r, lv, c.key) for r, _, lv in rows]
            if c.key in keep or any(cell != "—" for cell in cells):
                out.append((c, cells))
        return out

    has_conc = any(F.is_num(lv.get("concurrency")) for _, _, lv in rows)
    reuse = any(_reuses(r) for r in runs)
    main_cols = columns(tuple(c for c in LEVEL_COLUMNS if reuse or not c.key.startswith("prefix_cache.")),
                        _ALWAYS - (set() if has_conc or not rows else {"concurrency"}) | ({"prefix_cache.hit_rate"}
                                                                                          if reuse else set()))
    main_cols = [(c, cells) for c, cells in main_cols if c.key != "repeat" or any(x not in ("0", "—") for x in cells)]
    used: list[str] = []
    notes = []
    for r, li, _ in rows:
        codes = warn_codes.get((run_index[id(r)], li), [])
        used += [c for c in codes if c not in used]
        notes.append(", ".join(codes))
    body = [[str(r.get("label")), F.kv_name(r).display, *(cells[n] for _, cells in main_cols), notes[n]]
            for n, (r, _, _) in enumerate(rows)]
    main = Table(["Run", "KV", *(c.header for c, _ in main_cols), "Notes"], body,
                 [False, False, *(c.numeric for c, _ in main_cols), False], kind="levels")
    if not any(notes):  # no warnings in this scenario: no Notes column (cells cost PDF time)
        main = Table(main.headers[:-1], [row[:-1] for row in main.rows], main.numeric[:-1], kind="levels")
    details = []
    for name, cols in (("Latency detail", LATENCY_COLUMNS), ("Load and memory detail", LOAD_COLUMNS)):
        dcols = columns(cols, set())
        if not dcols:
            continue
        where = [F.fmt_x(*F.level_x(lv)) + (f" #{lv['repeat']}" if (lv.get("repeat") or 0) > 0 else "")
                 if F.level_x(lv) else "—" for _, _, lv in rows]
        drows = [[str(r.get("label")), where[n], *(cells[n] for _, cells in dcols)] for n, (r, _, _) in enumerate(rows)]
        details.append((name, Table(["Run", "Level", *(c.header for c, _ in dcols)], drows,
                                    [False, True, *(c.numeric for c, _ in dcols)], kind="levels")))
    return main, details + _workload_tables(rows), used


def _reuses(run: dict) -> bool:
    """The run's workload reuses prompts on purpose (shared prefixes, conversations, a dataset, a trace)."""
    return ((run.get("workload") or {}).get("kind") or "synthetic") != "synthetic"


def _lengths(s: Optional[dict]) -> str:
    return "—" if not s else f"{s['mean']:.0f} / {s['p50']:.0f} / {s['p99']:.0f}"


def _workload_tables(rows: list[tuple[dict, int, dict]]) -> list[tuple[str, Table]]:
    """The workload's shape beside what it measured: lengths asked and realised, the prefix cache and its
    reset per level; a histogram of realised prompt lengths per run; per-turn figures of conversations."""
    rows = [(r, li, lv) for r, li, lv in rows if lv.get("workload")]
    if not rows:
        return []
    out = []
    body = []
    for r, _, lv in rows:
        w, pc, reset = lv["workload"], lv.get("prefix_cache"), lv.get("cache_reset")
        checked = w.get("prompts_checked") or 0
        arrival = (w.get("arrival_error_ms") or {}).get("p99")
        body.append([str(r.get("label")), F.fmt_x(*F.level_x(lv)) if F.level_x(lv) else "—",
                     _lengths(w["prompt_tokens"]["asked"]), _lengths(w["prompt_tokens"]["realised"]),
                     _lengths(w["output_tokens"]["realised"]),
                     f"{w['prompts_exact']}/{checked}" if checked else "—",
                     level_cell(r, lv, "prefix_cache.hit_rate"),
                     "—" if not pc else f"{pc['hit_tokens']:,}/{pc['queried_tokens']:,}",
                     "—" if reset is None else ("yes" if reset["done"] else "no") + f": {reset['how']}",
                     "—" if arrival is None else f"{arrival:.2f}"])
    cols = ["Run", "Level", "Prompt asked (mean/p50/p99)", "Prompt realised", "Output realised", "Exact prompts",
            "Prefix-cache hits (%)", "Hit / looked-up tokens", "Cache reset before", "Arrival error p99 (ms)"]
    keep = [i for i in range(len(cols)) if i < 2 or any(row[i] != "—" for row in body)]
    out.append(("Workload", Table([cols[i] for i in keep], [[row[i] for i in keep] for row in body],
                                  [False, True, *([False] * (len(keep) - 2))], kind="wide")))
    hist = []
    seen: set[str] = set()
    for r, _, lv in rows:  # one histogram per run: its first level's realised prompt lengths
        bins = lv["workload"].get("prompt_histogram") or []
        if str(r.get("label")) in seen or not bins:
            continue
        seen.add(str(r.get("label")))
        top = max(b["count"] for b in bins) or 1
        hist += [[str(r.get("label")), f"{b['lo']}–{b['hi']}" if b["hi"] != b["lo"] else str(b["lo"]),
                  str(b["count"]), "█" * max(1 if b["count"] else 0, round(20 * b["count"] / top))] for b in bins]
    if hist:
        out.append(("Prompt lengths (realised, first level)",
                    Table(["Run", "Prompt tokens", "Requests", ""], hist, [False, True, True, False])))
    turns = [[str(r.get("label")), F.fmt_x(*F.level_x(lv)), str(t["turn"] + 1), str(t["requests"]),
              F.format_value("mean_prompt_tokens", t["mean_prompt_tokens"]),
              F.format_value("mean_prompt_tokens", t["mean_cached_tokens"]), F.format_value("ttft_p50_ms", t["ttft_p50_ms"])]
             for r, _, lv in rows for t in lv.get("turns") or []]
    if turns:
        out.append(("Conversation turns", Table(["Run", "Level", "Turn", "Requests", "Mean prompt tokens",
                                                 "Mean cached tokens", "TTFT p50 (ms)"], turns,
                                                [False, True, True, True, True, True, True])))
    return out


def _workload_text(w: dict) -> str:
    """The workload in a few words, for a scenario's description."""
    parts = [str(w.get("kind"))]
    pd = w.get("prompt_dist") or {}
    if pd.get("kind", "fixed") != "fixed":
        parts.append(f"prompt lengths {pd['kind']} (mean {pd['mean']:.0f})")
    if w.get("prefix_tokens"):
        parts.append(f"{w['prefix_groups']} shared prefix(es) of {w['prefix_tokens']} tokens")
    if (w.get("turns") or 1) > 1:
        parts.append(f"{w['turns']} turns, think time {w['think_time_s']:g} s")
    for key in ("dataset", "trace"):
        if w.get(key):
            parts.append(f"{key} {Path(w[key]['file']).name}" + (f" x{w[key]['time_scale']:g}" if key == "trace" else ""))
    return "workload: " + ", ".join(parts)


def _series(runs: list[dict], xkind: str, key: str, colours: dict[str, str], scale: float = 1.0,
            linestyle: str = "-") -> list[C.Series]:
    out = []
    for r in runs:
        pts = [(F.level_x(lv)[1], F.num(lv, key)) for lv in F.sorted_levels(r)  # type: ignore[index]
               if F.level_x(lv) and F.level_x(lv)[0] == xkind and F.usable(r, lv)]
        if any(y is not None for _, y in pts):
            out.append(C.Series(str(r.get("label")), colours[str(r.get("label"))], tuple(x for x, _ in pts),
                                tuple(None if y is None else y * scale for _, y in pts),
                                C.marker(r.get("backend")), linestyle))
    return out


def _wide_y(series: list[C.Series]) -> bool:
    ys = [y for s in series for y in s.ys if y is not None and y > 0]
    return bool(ys) and max(ys) / min(ys) > 50


def _chart_specs(scen: str, stem: str, runs: list[dict], xkind: str, colours: dict[str, str], agg: dict,
                 plans: dict[str, Optional[F.RunPlan]]) -> tuple[list[C.ChartSpec], list[str]]:
    xs = [F.level_x(lv)[1] for r in runs for lv in r.get("levels") or [] if F.level_x(lv) and F.level_x(lv)[0] == xkind]
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

    add("throughput", "throughput", "Throughput (tok/s)", _series(runs, xkind, "throughput_tok_s", colours))
    ttft = _series(runs, xkind, "ttft_p50_ms", colours) + _series(runs, xkind, "ttft_p95_ms", colours, linestyle=":")
    wide = _wide_y(ttft)
    add("ttft", "TTFT p50 and p95", "Time to first token (ms" + (", log scale)" if wide else ")"), ttft,
        style_key=(("-", "p50"), (":", "p95")), logy=wide)
    tpot = _series(runs, xkind, "tpot_p50_ms", colours) + _series(runs, xkind, "tpot_p95_ms", colours, linestyle=":")
    has_p95 = any(s.linestyle == ":" for s in tpot)
    add("tpot", "TPOT p50" + (" and p95" if has_p95 else ""), "Time per output token (ms)", tpot,
        style_key=(("-", "p50"), (":", "p95")) if has_p95 else ())
    mem = _series(runs, xkind, "peak_vram_gib", colours)
    rss = _series(runs, xkind, "peak_rss_gib", colours, linestyle="-.")
    gib = agg.get("gpu_gib")
    add("memory", "peak memory", "Peak memory (GiB)", mem + rss,
        hlines=((float(gib), f"GPU memory {F.format_value('gpu_gib', gib)} GiB"),) if F.is_num(gib) and mem else (),
        style_key=((("-", "VRAM"), ("-.", "process RSS")) if rss and mem else ()))
    kv = _series(runs, xkind, "peak_kv_cache_usage", colours, scale=100)
    planned, calibrated, sources = [], [], []
    if xkind == "concurrency":
        for r in runs:
            plan = plans.get(str(r.get("label")))
            if plan is None or F.run_status(r) == "failed":
                continue
            for levels, dest, ls in ((plan.levels, planned, "--"), (plan.calibrated_levels, calibrated, "-.")):
                pts = [p for p in levels if p.predicted_kv_usage is not None]
                if pts:
                    dest.append(C.Series(str(r.get("label")), colours[str(r.get("label"))], tuple(p.x for p in pts),
                                         tuple(p.predicted_kv_usage * 100 for p in pts),  # type: ignore[operator]
                                         C.marker(r.get("backend")), ls))
                    sources.append(plan.source)
    hidden = [str(r.get("label")) for r in runs if r.get("levels") and not F.exposes(r, "peak_kv_cache_usage")]
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
        notes.append("Planner lines derived from the calibration table's inputs by kvexp's planner, assuming each request "
                     "holds prompt + max tokens.")
    return specs, notes


def _scenario_views(agg: dict, colours: dict[str, str], warnings: list[F.LevelWarning], png_dir: Optional[Path],
                    svg: bool) -> list[dict]:
    runs_all = list(agg.get("runs") or [])
    run_index = {id(r): i for i, r in enumerate(runs_all)}
    warn_codes: dict[tuple[int, int], list[str]] = {}
    for w in warnings:
        codes = warn_codes.setdefault((w.run_index, w.level_index), [])
        if w.code not in codes:
            codes.append(w.code)
    plans = {str(r.get("label")): F.run_plan(r, agg) for r in runs_all}
    out = []
    stems: set[str] = set()
    for scen, runs in F.scenarios(agg):
        stem = _slug(scen)
        while stem in stems:  # two names with one slug ("a b", "a-b") must not share chart files
            stem += "-x"
        stems.add(stem)
        main, details, codes = _level_tables(runs, warn_codes, run_index)
        kinds = _uniq(F.level_x(lv)[0] for r in runs for lv in F.sorted_levels(r) if F.level_x(lv))
        charts, notes = [], []
        for xkind in kinds:
            specs, n = _chart_specs(scen, stem, runs, xkind, colours, agg, plans)
            notes += n
            charts += [C.render_chart(s, png_dir, svg) for s in specs]
        entries = [(str(r.get("label")), colours[str(r.get("label"))], C.marker(r.get("backend")))
                   for r in runs if any(F.usable(r, lv) for lv in r.get("levels") or [])]
        # The legend: a PNG beside the Markdown; in HTML a list of coloured glyphs (cheaper than an SVG).
        legend = C.render_legend(f"{stem}-legend", entries, png_dir, svg=False) \
            if entries and charts and png_dir is not None else None
        legend_items = [{"label": lab, "colour": col, "glyph": C.MARKER_GLYPHS.get(m, "●")}
                        for lab, col, m in entries] if charts else []
        # a trace's or a dataset's own lengths, not the scenario's, are what was sent
        own = [r for r in runs if (r.get("workload") or {}).get("kind") not in ("trace", "dataset")]
        prompt = _uniq(r.get("prompt_tokens") for r in own)
        maxt = _uniq(r.get("max_tokens") for r in own)
        desc = []
        if prompt:
            desc.append(f"prompt {', '.join(map(str, prompt))} tokens")
        if maxt:
            desc.append(f"up to {', '.join(map(str, maxt))} output tokens")
        desc += _uniq(_workload_text(r.get("workload")) for r in runs if _reuses(r) or
                      ((r.get("workload") or {}).get("prompt_dist") or {}).get("kind", "fixed") != "fixed")
        desc.append(f"{len(runs)} run{'s' if len(runs) != 1 else ''}")
        failed = [{"label": str(r.get("label")), "status": F.run_status(r),
                   "reason": F.first_line(r.get("status_reason")) or "no reason recorded"}
                  for r in runs if F.run_status(r) in ("failed", "partial", "skipped")]
        out.append({
            "name": scen, "anchor": stem, "description": "; ".join(desc), "table": main, "details": details,
            "codes": [(c, F.WARNING_CODES.get(c, c)) for c in codes],
            "kv_label_note": any(F.kv_name(r).source == "label" for r in runs), "charts": charts, "legend": legend,
            "legend_items": legend_items,
            "notes": notes, "failed": failed,
        })
    return out


def _planner_view(agg: dict) -> dict:
    pl = agg.get("planner") if isinstance(agg.get("planner"), dict) else {}
    constants: list[tuple[str, str]] = []
    names = {"gpu_memory_utilization": "GPU memory utilisation", "overhead_gib": "Overhead (GiB)",
             "block_size": "Block size (tokens)"}
    for k, v in pl.items():
        if k in ("gib", "models", "kv_bytes"):
            continue
        if k == "gpu_memory_utilization" and F.is_num(v):
            constants.append((names[k], f"{v * 100:.0f} %"))
        elif not isinstance(v, (dict, list)):
            constants.append((names.get(k, k), F.format_value(k, v)))
    kvb = pl.get("kv_bytes") if isinstance(pl.get("kv_bytes"), dict) else {}
    if kvb:
        constants.append(("KV bytes per element", ", ".join(f"{k} {F.format_value('b', v)}" for k, v in kvb.items())))

    presets = None
    models = pl.get("models") if isinstance(pl.get("models"), dict) else {}
    if models:
        rows = []
        for name, m in models.items():
            if not isinstance(m, dict):
                continue
            per_tok = []
            if all(F.is_num(m.get(k)) for k in ("n_layers", "n_kv_heads", "head_dim")):
                for dt, b in kvb.items():
                    if F.is_num(b):
                        bpt = kv_bytes_per_token(m["n_layers"], m["n_kv_heads"], m["head_dim"], b)
                        per_tok.append(f"{dt} {bpt / 1024:.1f}")
            rows.append([str(name), F.format_value("n", m.get("n_layers")), F.format_value("n", m.get("n_kv_heads")),
                         F.format_value("n", m.get("head_dim")), F.format_value("params_b", m.get("params_b")),
                         ", ".join(per_tok) or "—"])
        presets = Table(["Preset", "Layers", "KV heads", "Head dim", "Params (B)", "KV KiB/token"], rows,
                        [False, True, True, True, True, False])

    plans = [(r, F.run_plan(r, agg)) for _, sruns in F.scenarios(agg) for r in sruns]
    cap_rows = []
    for r, p in plans:  # one row per run: each run's own planner error, never one row for several runs
        if p is None:
            continue
        kv = F.kv_name(r)
        server = _kv_capacity(r.get("kv_cache") or {})
        diff = (server - p.capacity_tokens) / p.capacity_tokens * 100 if server and p.capacity_tokens else None
        cap_rows.append([str(r.get("label")), F.backend_name(r.get("backend")), str(r.get("model")), kv.display,
                         F.format_value("kv_bytes_per_token", p.kv_bytes_per_token),
                         F.format_value("capacity_tokens", p.capacity_tokens),
                         F.format_value("capacity_tokens", p.calibrated_capacity_tokens),
                         F.format_value("capacity_tokens", server),
                         "—" if diff is None else f"{diff:+.1f}", p.source])
    capacity = Table(["Run", "Backend", "Model", "KV", "KV bytes/token", "Planner capacity (tokens)",
                      "Calibrated capacity (tokens)", "Server capacity (tokens)", "Server vs planner (%)", "Source"],
                     cap_rows, [False, False, False, False, True, True, True, True, True, False]) if cap_rows else None

    pre_rows = []
    for r, p in plans:
        if p is None:
            continue
        levels = [lv for lv in F.sorted_levels(r) if F.level_x(lv) and F.level_x(lv)[0] == "concurrency"]
        top = F.format_value("concurrency", F.num(levels[-1], "concurrency")) if levels else "—"

        def first(rows: tuple[F.PlanLevel, ...], what: str) -> str:
            hit = next((q for q in rows if getattr(q, what)), None)
            if hit:
                return F.format_value("concurrency", hit.x)
            known = [q for q in rows if getattr(q, what) is not None]
            return f"none up to {F.format_value('concurrency', known[-1].x)}" if known else "—"

        if F.exposes(r, "preemptions"):
            obs = next((lv for lv in levels if F.num(lv, "preemptions")), None)
            observed = F.format_value("concurrency", obs["concurrency"]) if obs else f"none up to {top}"
        else:
            observed = NOT_EXPOSED
        pre_rows.append([
            str(r.get("scenario")), str(r.get("label")), F.format_value("tokens", p.tokens_per_request),
            F.format_value("concurrency", p.max_concurrency),
            F.format_value("concurrency", p.calibrated_max_concurrency),
            first(p.levels, "predicts_preemption"), first(p.calibrated_levels, "predicts_preemption"), observed,
            F.format_value("concurrency", p.max_concurrent_requests), first(p.levels, "predicts_queueing"),
            level_cell(r, levels[-1], "peak_kv_cache_usage") if levels else "—",
        ])
    preemption = Table(["Scenario", "Run", "Tokens/request", "Max concurrency (planner)",
                        "Max concurrency (calibrated)", "Predicted preemption at", "Predicted (calibrated)",
                        "Observed preemption at", "Served at once (planner)", "Predicted queueing at",
                        "Peak KV usage at top level (%)"],
                       pre_rows, [False, False, *[True] * 9], kind="wide") if pre_rows else None
    if preemption is not None:
        preemption = drop_empty(preemption, keep=2)

    cal = [row for row in agg.get("calibration") or [] if isinstance(row, dict)]
    calibration = None
    if cal:
        has_cal = any(row.get("calibrated_tokens") is not None for row in cal)
        cols = [("model", "Model", False), ("preset", "Preset", False), ("backend", "Backend", False),
                ("kv_cache_dtype", "KV", False), ("gpu_gib", "GPU (GiB)", True), ("weights_gib", "Weights (GiB)", True),
                ("gpu_memory_utilization", "GPU mem. util. (%)", True),
                ("predicted_tokens", "Predicted (tokens)", True),
                ("actual_tokens", "Actual (tokens)", True), ("error_pct", "Error (%)", True)]
        if has_cal:
            cols += [("calibrated_tokens", "Calibrated (tokens)", True),
                     ("calibrated_error_pct", "Calibrated error (%)", True)]
        cols = [c for c in cols if c[0] != "backend" or any(row.get("backend") for row in cal)]
        checks = {c.index: c for c in recompute.check_document(agg)}
        rows = []
        for i, row in enumerate(cal):
            vals = dict(row)
            actual = vals.get("actual_tokens")
            for pred, err in (("predicted_tokens", "error_pct"), ("calibrated_tokens", "calibrated_error_pct")):
                if vals.get(err) is None and F.is_num(vals.get(pred)) and F.is_num(actual) and actual:
                    vals[err] = (vals[pred] - actual) / actual * 100
            rows.append([F.format_value(k, vals.get(k)) for k, _, _ in cols] + _check_cells(checks.get(i)))
        calibration = Table([h for _, h, _ in cols] + list(CHECK_HEADERS), rows,
                            [n for _, _, n in cols] + [True, True, False], kind="wide")
    return {"constants": constants, "presets": presets, "capacity": capacity, "preemption": preemption,
            "calibration": calibration, "whatif": _whatif_view(agg),
            "derived": any(p is not None and p.source == "calibration table" for _, p in plans)}


CHECK_HEADERS = ("kvexp planner (tokens)", "kvexp error (%)", "Document vs kvexp")


def _check_cells(c: Optional[recompute.Check]) -> list[str]:
    """kvexp's own prediction for a calibration row, its error, and whether the document agrees."""
    if c is None or c.kvexp_tokens is None:
        return ["—", "—", "not recomputed" + (f": {c.reason}" if c is not None and c.reason else "")]
    verdict = ("agrees" if c.agrees else "no prediction in the document" if c.agrees is None
               else f"DISAGREES: document {c.document_tokens:,}")
    return [F.format_value("capacity_tokens", c.kvexp_tokens), F.format_value("error_pct", c.kvexp_error_pct),
            verdict]


def _whatif_configs(agg: dict) -> list[tuple[tuple, Optional[str]]]:
    """What-if configurations of an aggregate with their scenario: every run's own planner block, and
    every calibration row kvexp recomputed (with the prompt and output length of its runs)."""
    out: dict[tuple, tuple[tuple, Optional[str]]] = {}
    checks = [c for c in recompute.check_document(agg) if c.kvexp_tokens is not None]
    for r in agg.get("runs") or []:
        adapter = backends.find(recompute.run_name(r.get("backend")))
        if adapter is None:
            continue
        p = r.get("planner")
        configs = []
        if isinstance(p, dict) and isinstance(p.get("inputs"), dict):
            configs.append(whatif.from_plan(p, adapter.cache_model))
        for c in checks:
            if (c.backend == adapter.name and str(c.model) == str(r.get("model"))
                    and recompute.run_kv(r) == c.kv_dtype and F.is_num(r.get("prompt_tokens"))):
                inputs = {**c.inputs, "prompt_tokens": r["prompt_tokens"], "max_tokens": r.get("max_tokens") or 0}
                configs.append((inputs, {}, adapter.cache_model, adapter.name))
        for cfg in configs:
            i = cfg[0]
            key = (cfg[3], i.get("model"), i.get("kv_dtype"), i.get("prompt_tokens"), i.get("max_tokens"))
            out.setdefault(key, (cfg, str(r.get("scenario"))))
    return list(out.values())


def _whatif_view(agg: dict) -> Optional[Table]:
    """The what-if table: each configuration on each conf/gpu preset, with this machine's fitted
    overheads (the calibration file; none when it cannot be read)."""
    from kvexp.planning import calibration as cal

    configs = _whatif_configs(agg)
    if not configs:
        return None
    try:
        table = cal.load()
    except cal.CalibrationError as e:
        log.warning("%s", e)
        table = None
    rows = []
    for g in whatif.gpu_presets():
        for cfg, scen in configs:
            rows.append(whatif.row_cells(whatif.what_if(cfg[0], cfg[1], cfg[2], g, table, backend=cfg[3]), scen))
    return Table(list(whatif.HEADERS), rows, [False] * 6 + [True] * 3 + [False] + [True] * 3, kind="wide")


_FINDING_GROUPS = (
    ("Problems", ("failed", "partial", "skipped", "failed_level")),
    ("Best configurations", ("best_overall_throughput", "best_overall_ttft_p95")),
    ("KV-cache dtype", ("kv_gain",)),
    ("KV dtype: capacity and speed against quality", ("quality_trade", "quality_nondeterministic")),
    ("Saturation and queueing", ("no_growth", "saturation")),
    ("Preemption", ("preemption", "no_preemption")),
    ("Caveats", ("variable_length", "not_exposed")),
    ("Best per level", ("best_throughput", "best_ttft_p95")),
)


def _quality_view(agg: dict, colours: dict[str, str], png_dir: Optional[Path], svg: bool) -> Optional[dict]:
    """The quality section: one row per run and context depth (teacher-forced drift from the 16-bit KV
    baseline, beside the run's KV capacity and its continuation agreement) and a chart of mean KLD
    against context depth; None when no run measured quality."""
    from kvexp.analysis.qualityfindings import fmt_kld, fmt_share

    runs = [r for r in agg.get("runs") or [] if isinstance(r.get("quality"), dict)]
    if not runs:
        return None
    headers = ["Run", "KV", "Baseline", "Depth", "Positions", "Mean KLD", "Median KLD", "p99 KLD", "Top-1 agree",
               "PPL base", "PPL", "ΔPPL", "KV capacity (tokens)", "Identical continuations", "First diff (mean)",
               "Prefix agree", "Baseline from"]
    rows, series, methods, notes = [], [], {}, []
    for r in runs:
        q = r["quality"]
        tf, cont, base = q.get("teacher_forced") or {}, q.get("continuation") or {}, q.get("baseline") or {}
        if tf.get("method"):
            methods[tf["method"]] = tf.get("precision")
        depths = tf.get("depths") or [{}]
        cap = (r.get("kv_cache") or {}).get("capacity_tokens")
        src = "cache" if base.get("cached") else ("this job" if base.get("measured_by_this_job") else "—")
        for d in depths:
            status = d.get("status")
            rows.append([
                str(r.get("label")), str(q.get("kv")), str(base.get("kv")),
                F.format_value("context", d.get("context")), F.format_value("positions", d.get("positions")),
                fmt_kld(d.get("kld_mean")), fmt_kld(d.get("kld_median")), fmt_kld(d.get("kld_p99")),
                fmt_share(d.get("top1_agreement")), F.format_value("ppl", d.get("ppl_base")),
                F.format_value("ppl", d.get("ppl")), F.format_value("delta_ppl", d.get("delta_ppl")),
                F.format_value("capacity_tokens", cap), fmt_share(cont.get("identical_share")),
                F.format_value("first_diff", cont.get("first_diff_mean")), fmt_share(cont.get("prefix_agreement")),
                src])
            if status and status != "ok":
                notes.append(f"{r.get('label')}, depth {d.get('context')}: {status}: {d.get('reason')}")
        if tf.get("reason"):
            notes.append(f"{r.get('label')}: teacher-forced drift not measured: {tf['reason']}")
        if cont.get("reason"):
            notes.append(f"{r.get('label')}: continuations: {cont['reason']}")
        notes += [f"{r.get('label')}: {w}" for w in q.get("warnings") or []]
        pts = [(float(d["context"]), float(d["kld_mean"])) for d in tf.get("depths") or []
               if d.get("status") == "ok" and F.is_num(d.get("kld_mean")) and d["kld_mean"] > 0]
        if q.get("kv") == base.get("kv"):  # the baseline against itself: the method's floor, in the table
            pts = []
        if pts:
            label = str(r.get("label"))
            series.append(C.Series(label, colours.get(label, "#1f77b4"), tuple(x for x, _ in pts),
                                   tuple(y for _, y in pts), C.marker(r.get("backend"))))
    ys = [y for s_ in series for y in s_.ys if y is not None]
    logy = bool(ys) and max(ys) / min(ys) > 20
    if series:
        notes.append("The chart shows the KV dtypes other than the baseline; the baseline against itself (the "
                     "method's floor) is in the table.")
    charts = []
    if series:
        spec = C.ChartSpec("quality-kld", "Mean KLD from the 16-bit KV cache vs context depth",
                           "Context depth (tokens)", "Mean KLD (nats" + (", log scale)" if logy else ")"),
                           tuple(series), logx=True, logy=logy)
        charts.append(C.render_chart(spec, png_dir, svg))
    entries = [(s_.label, s_.colour, s_.marker) for s_ in series]
    legend = C.render_legend("quality-legend", entries, png_dir, svg=False) if entries and png_dir is not None else None
    table = Table(headers, rows, [False, False, False] + [True] * 13 + [False], kind="wide")
    return {"table": drop_empty(table, keep=4), "charts": charts, "notes": notes, "legend": legend,
            "legend_items": [{"label": lab, "colour": col, "glyph": C.MARKER_GLYPHS.get(m, "●")}
                             for lab, col, m in entries],
            "methods": [f"{m}: {p}" if p else m for m, p in methods.items()]}


def build_context(aggregate: dict, title: Optional[str] = None, png_dir: Optional[Path] = None,
                  svg: bool = True) -> dict:
    """Everything the templates show, as plain strings, tables and rendered charts."""
    if not isinstance(aggregate, dict) or not isinstance(aggregate.get("runs"), list):
        raise ReportError("the aggregate has no runs list: expected the reference shape (gpu, runs[], ...)")
    runs = aggregate["runs"]
    keys = {str(r.get("label")): _colour_key(r) for r in runs}
    by_key = C.colour_map(keys.values())
    colours = {label: by_key[k] for label, k in keys.items()}
    findings = F.compute_findings(aggregate)
    warnings = F.level_warnings(aggregate)
    groups = []
    checks = recompute.check_document(aggregate)
    if checks:
        groups.append({"name": "Planner predictions, recomputed by kvexp",
                       "sentences": [c.sentence for c in sorted(checks, key=lambda c: c.agrees is not False)]})
    for name, kinds in _FINDING_GROUPS:
        items = [f.sentence for f in findings if f.kind in kinds]
        if items:
            groups.append({"name": name, "sentences": items})
    failures = [{"label": str(r.get("label")), "status": F.run_status(r), "scenario": str(r.get("scenario")),
                 "reason": _tail(r.get("status_reason")) or "no reason recorded"}
                for r in runs if F.run_status(r) in ("failed", "partial", "skipped")]
    from kvexp.analysis.recommend import recommendations

    return {
        "recommendations": [r["sentence"] for r in recommendations(aggregate)],
        "title": title or aggregate.get("title") or default_title(aggregate),
        "rendered": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "kvexp_version": aggregate.get("kvexp_version") or (aggregate.get("environment") or {}).get("kvexp_version"),
        "findings": groups,
        "setup": _setup_view(aggregate),
        "scenarios": _scenario_views(aggregate, colours, warnings, png_dir, svg),
        "planner": _planner_view(aggregate),
        "quality": _quality_view(aggregate, colours, png_dir, svg),
        "warnings": [w.message for w in warnings],
        "failures": failures,
        "not_exposed": NOT_EXPOSED,
        "not_recorded": NOT_RECORDED,
    }


# ----------------------------------------------------------------------------------------------
# Files


def _environment() -> Environment:
    env = Environment(loader=FileSystemLoader(str(templates_dir())), undefined=StrictUndefined,
                      autoescape=lambda name: bool(name) and name.endswith((".html.j2", ".html")),
                      trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters["md"] = md_escape
    env.filters["md_table"] = md_table
    env.filters["md_code"] = md_code
    return env


def validate_aggregate(doc: dict) -> None:
    """Validate against the aggregate schema when kvexp.results.validate is available (the one call site)."""
    try:
        from kvexp.results.validate import validate_document  # type: ignore[import-not-found]
    except ModuleNotFoundError as e:
        if e.name in ("kvexp.results.validate",):
            return  # not written yet: nothing to validate against
        raise
    validate_document(doc, "aggregate")


def write_csv(aggregate: dict, path: Path) -> Path:
    """One row per run and level; runs without levels get one row with empty level columns."""
    return atomic_write(path, csv_text(aggregate))


def csv_text(aggregate: dict) -> str:
    """comparison.csv's text: level_table with empty cells for missing values, JSON for lists and objects."""
    head, rows = level_table(aggregate)

    def cell(v: Any) -> Any:
        if v is None:
            return ""
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (list, dict)):
            return json.dumps(v, sort_keys=True)
        return v

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(head)
    for row in rows:
        w.writerow([cell(v) for v in row])
    return buf.getvalue()


def level_table(aggregate: dict) -> tuple[list[str], list[list[Any]]]:
    """comparison.csv as values: its column names and one row per run and level (None where missing).
    A `tool` column (kvexp or the benchmark tool that measured the run) is there when a run came from
    another tool's file."""
    runs = list(aggregate.get("runs") or [])
    present = {k for r in runs for lv in r.get("levels") or [] for k in _flat_keys(lv)}
    extra = sorted(present - set(CSV_LEVEL_KEYS))
    level_keys = [k for k in CSV_LEVEL_KEYS if k in present or k in _ALWAYS] + extra
    tools = any(r.get("tool") for r in runs)
    head = ["label", *(["tool"] if tools else []), "backend", "model", "scenario", "kv_dtype", "kv_dtype_source",
            "run_status", *level_keys]
    rows = []
    for r in runs:
        kv = F.kv_name(r)
        base = [r.get("label"), *([tool_name(r)] if tools else []), r.get("backend"), r.get("model"),
                r.get("scenario"), kv.name, kv.source, F.run_status(r)]
        for lv in r.get("levels") or [{}]:
            rows.append(base + [F.level_value(lv, k) for k in level_keys])
    return head, rows


NESTED_LEVEL_BLOCKS = ("server", "delivery", "prefix_cache")  # a level's blocks whose figures get a column each


def _flat_keys(level: dict) -> list[str]:
    """A level's keys, with the figures of its NESTED_LEVEL_BLOCKS as dotted keys."""
    out = []
    for k, v in level.items():
        if k in NESTED_LEVEL_BLOCKS and isinstance(v, dict):
            out += [f"{k}.{inner}" for inner in v]
        else:
            out.append(k)
    return out


def render_report(aggregate: dict, out_dir: Path, title: Optional[str] = None,
                  formats: Iterable[str] = FORMATS) -> dict[str, Path]:
    """Write report.md (+ charts/*.png), report.html (inline SVG), report.pdf, comparison.json and
    comparison.csv into out_dir. Returns {"md", "html", "pdf", "json", "csv", "charts"} -> Path for what
    was written; a skipped PDF leaves a one-line message in the result's `problems`."""
    formats = tuple(formats)
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ReportError(f"formats={list(formats)}: unknown {', '.join(unknown)}; "
                          f"allowed values are {', '.join(FORMATS)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    validate_aggregate(aggregate)
    want_svg = "html" in formats or "pdf" in formats
    png_dir = out_dir / "charts" if "md" in formats else None
    ctx = build_context(aggregate, title, png_dir, want_svg)
    env = _environment()
    files = ReportFiles()
    if "md" in formats:
        files["md"] = atomic_write(out_dir / "report.md", env.get_template("report.md.j2").render(ctx))
        if png_dir is not None and png_dir.is_dir():
            files["charts"] = png_dir
    html = None
    if want_svg:
        css_path = templates_dir() / "report.css"
        ctx["css"] = Markup(css_path.read_text(encoding="utf-8")) if css_path.is_file() else ""
        html = env.get_template("report.html.j2").render(ctx)
        if "html" in formats:
            files["html"] = atomic_write(out_dir / "report.html", html)
    files["json"] = atomic_write(out_dir / "comparison.json",
                                 json.dumps(_json_safe(aggregate), indent=2, ensure_ascii=False) + "\n")
    files["csv"] = write_csv(aggregate, out_dir / "comparison.csv")
    if "pdf" in formats and html is not None:
        try:
            files["pdf"] = pdf.write(html, out_dir / "report.pdf", out_dir)
        except pdf.PDFUnavailable as e:
            log.warning("%s", e)
            files.problems.append(str(e))
    return files
