"""Markdown summaries: one per job (next to its result.json) and one per sweep."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2

from kvexp.paths import data_dir
from kvexp.results import collect, write_json

COLUMNS = [  # (key, header) in the reference document's order, then kvexp's additions
    ("concurrency", "concurrency"), ("requests", "requests"), ("errors", "errors"),
    ("throughput_tok_s", "tok/s"), ("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p95_ms", "TTFT p95 ms"),
    ("ttft_p99_ms", "TTFT p99 ms"), ("tpot_p50_ms", "TPOT p50 ms"), ("itl_p50_ms", "ITL p50 ms"),
    ("e2e_p50_ms", "E2E p50 ms"), ("peak_vram_gib", "peak VRAM GiB"), ("peak_rss_gib", "server RSS GiB"),
    ("peak_kv_cache_usage", "peak KV usage"), ("preemptions", "preemptions"),
    ("mean_prompt_tokens", "mean prompt tok"), ("mean_output_tokens", "mean output tok"), ("wall_s", "wall s"),
]
NOT_EXPOSED = {"peak_kv_cache_usage", "preemptions", "peak_vram_gib"}


def cell(level: dict[str, Any], key: str) -> str:
    v = level.get(key)
    if key == "concurrency" and v is None and level.get("rate") is not None:
        return f"{level['rate']:g} req/s"
    if v is None:
        return "not exposed" if key in NOT_EXPOSED else "—"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v).replace("|", "\\|")


def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(data_dir("templates"))),
                             autoescape=False, undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters["cell"] = cell
    env.filters["md"] = lambda v: "—" if v is None else str(v).replace("|", "\\|")
    return env


def render_job_summary(result: dict[str, Any]) -> str:
    return _env().get_template("summary.md.j2").render(r=result, columns=COLUMNS)


def write_job_summary(result: dict[str, Any], out_dir: Path) -> Path:
    path = out_dir / "summary.md"
    path.write_text(render_job_summary(result))
    return path


def write_sweep_outputs(sweep_dir: Path) -> list[Path]:
    """The sweep's aggregate JSON, its Markdown summary and (where available) the full report."""
    agg = collect([sweep_dir])
    written = []
    path = sweep_dir / "sweep.json"
    write_json(path, agg, "aggregate")
    written.append(path)
    path = sweep_dir / "summary.md"
    path.write_text(_env().get_template("sweep.md.j2").render(a=agg, columns=COLUMNS))
    written.append(path)
    try:
        from kvexp.report import render_report
    except ImportError:
        return written
    written += list(render_report(agg, sweep_dir / "report").values())
    return written
