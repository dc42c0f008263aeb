"""Markdown summaries: one per job (next to its result.json) and one per sweep, with the repeats of a
level as mean, 95 % confidence interval and coefficient of variation, and the sweep's time broken
down into server starts, warm-up, measurement and the rest. Their level columns are registry keys
(kvexp.metrics.registry: header, format and missing-value rule); the Markdown goes through the one Jinja
environment (kvexp.report.templating). Also the planner's tables of `kvexp plan`."""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Optional

from jinja2 import Environment

from kvexp import backends
from kvexp.analysis.aggregate import collect, run_of, verdicts_of
from kvexp.analysis.verdict import short_names, verdicts
from kvexp.core.config import ConfigError, ExperimentConfig
from kvexp.metrics import registry
from kvexp.metrics.levels import Level
from kvexp.metrics.stats import UNSTABLE_CV
from kvexp.planning import memory, prediction, whatif
from kvexp.report import pdf
from kvexp.report.tables import Table, header, level_name, numeric, peak_table, text_table
from kvexp.report.templating import environment
from kvexp.results.blocks import Plan, PlanInputs, PlanRow
from kvexp.results.documents import JobResult, Timing
from kvexp.results.runs import Aggregate
from kvexp.results.store import RESULT_FILE, ResultError, load_document, write_json

# The level tables' columns, registry keys: what a reader decides from (every other figure is in
# result.json, comparison.csv and the report's detail tables).
COLUMNS = ("concurrency", "requests", "errors", "throughput_tok_s", "ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms",
           "itl_p50_ms", "e2e_p50_ms", "peak_vram_gib", "peak_rss_gib", "peak_kv_cache_usage", "preemptions")
# shown only when some level of the job has them
OPTIONAL_COLUMNS = ("repeat", "goodput_req_s", "server.tpot_p50_ms")
# figures summarised over a level's repeats (each in registry.REPEATED), then how many repeats
REPEAT_COLUMNS = ("throughput_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p50_ms", "goodput_req_s")
LEVEL_HEADER = "Level"  # the repeats table's first column: a level's concurrency or rate (not a metric)


def columns_for(levels: list[Level]) -> list[str]:
    """COLUMNS, then the optional ones some level has (repeat: only when a level was repeated)."""
    extra = [k for k in OPTIONAL_COLUMNS if any((lv.repeat or 0) > 0 if k == "repeat"
                                                else lv.value(k) is not None for lv in levels)]
    return [COLUMNS[0], *(k for k in extra if k == "repeat"), *COLUMNS[1:], *(k for k in extra if k != "repeat")]


def cell(level: Level, key: str, *, failed: bool, exposed: bool, foreign: bool = False) -> str:
    """One level figure (registry.format_value); a null one by registry.missing_text: `failed` when the
    level or its run failed, `exposed` when another level of the run has the figure."""
    if key == "concurrency":
        return level_name(level)
    v = level.value(key)
    if key == "repeat" and isinstance(v, int):
        return str(v + 1)
    return registry.level_text(level, key, failed=failed, exposed=exposed, foreign=foreign)


def levels_table(levels: list[Level], status: Optional[str], foreign: bool = False) -> Table:
    """A run's levels, one row each, in the columns of columns_for; `status` is the run's."""
    keys = columns_for(levels)
    exposed = {k: any(registry.is_num(lv.value(k)) for lv in levels) for k in keys}
    rows = [[cell(lv, k, failed=status in ("failed", "skipped") or lv.failed,
                  exposed=exposed[k], foreign=foreign) for k in keys] for lv in levels]
    return Table([header(k) for k in keys], rows, [numeric(k) for k in keys])


def repeat_cell(level: Level, key: str) -> str:
    """A figure over a level's repeats: mean ± 95 % CI (CV), flagged when unstable."""
    mean, ci95, cv = (level.value(f"repeats.{key}.{k}") for k in ("mean", "ci95", "cv"))
    if mean is None:
        return registry.UNKNOWN
    text = f"{mean:.4g}"
    if ci95 is not None:
        text += f" ± {ci95:.2g}"
    if cv is not None:
        text += f" (CV {cv * 100:.1f} %)"
        if cv >= UNSTABLE_CV:
            text += " **unstable**"
    return text


def repeats_table(levels: list[Level]) -> Optional[Table]:
    """The levels measured more than once: REPEAT_COLUMNS over their repeats and how many; None if none."""
    rows = [[level_name(lv), *(repeat_cell(lv, k) for k in REPEAT_COLUMNS),
             registry.format_value("repeats", lv.value("repeats.throughput_tok_s.n"))]
            for lv in levels if lv.repeats]
    if not rows:
        return None
    return Table([LEVEL_HEADER, *(header(k) for k in REPEAT_COLUMNS), header("repeats")], rows,
                 [True] * (len(REPEAT_COLUMNS) + 2))


def run_tables(aggregate: Aggregate) -> list[dict[str, Any]]:
    """Per run of an aggregate that has levels: its label, level table and repeats table."""
    return [{"label": run.label, "levels": levels_table(run.levels, run.state, bool(run.tool)),
             "repeats": repeats_table(run.levels)} for run in aggregate.runs if run.levels]


def _env() -> Environment:
    """The shared environment (kvexp.report.templating) with the summaries' own filters and globals."""
    return environment(filters={"level_name": level_name, "seconds": lambda v: "—" if v is None else f"{v:.1f}"},
                       globals={"unstable_cv": UNSTABLE_CV})


def render_job_summary(result: JobResult) -> str:
    levels = result.levels
    run = run_of(result)  # a job with a latency objective: its verdict in the words the terminal and report use
    said = [v.sentence for v in verdicts(Aggregate(runs=[run]))] if run.objectives is not None and levels else []
    return _env().get_template("summary.md.j2").render(r=result, levels=levels_table(levels, result.status),
                                                        repeats=repeats_table(levels), verdicts=said)


def write_job_summary(result: JobResult, out_dir: Path) -> Path:
    path = out_dir / "summary.md"
    path.write_text(render_job_summary(result))
    return path


def _when(stamp: Optional[str]) -> Optional[datetime]:
    try:
        return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ") if stamp else None
    except ValueError:
        return None


def _server_key(result: JobResult) -> Optional[tuple]:
    cmd = result.backend.launch_command
    if not cmd:
        return None
    return tuple("<port>" if i and cmd[i - 1] == "--port" else a for i, a in enumerate(cmd))


def sweep_timing(results: Iterable[JobResult], wall_s: Optional[float] = None,
                 since: Optional[datetime] = None) -> dict[str, Any]:
    """Where a sweep's time went, from the jobs' own timing (server_start_s, warmup_s, measure_s,
    total_s): server starts (and for how many distinct server configurations), warm-up, measurement,
    the rest of the jobs' time, and what the sweep spent outside its jobs. wall_s is the sweep's wall
    time when known; otherwise it is taken from the jobs' start and finish stamps (whole seconds).
    since (UTC, naive): when this run of the sweep began; a resumed sweep's jobs that finished before
    it were not run now, and are counted apart (earlier_jobs), not as time spent in this wall time."""
    ran = [r for r in results if r.status != "skipped"]
    earlier = []
    if since is not None:
        earlier = [r for r in ran if (w := _when(r.finished_at)) and w < since.replace(microsecond=0)]
        ran = [r for r in ran if all(r is not e for e in earlier)]
    t = [r.timing or Timing() for r in ran]
    starts = [x.server_start_s for x in t if x.server_start_s]
    configs = {k for r in ran if (k := _server_key(r)) is not None}
    total = {k: sum(getattr(x, k) or 0.0 for x in t) for k in ("server_start_s", "warmup_s", "measure_s", "total_s")}
    slack = 0.0
    if wall_s is None:  # from stamps in whole seconds: allow for their rounding
        begun = [w for r in ran if (w := _when(r.started_at))]
        ended = [w for r in ran if (w := _when(r.finished_at))]
        wall_s = (max(ended) - min(begun)).total_seconds() if begun and ended else None
        slack = 2.0
    jobs_s = total["total_s"]
    parallel = bool(wall_s and jobs_s > wall_s * 1.05 + slack)
    out = {
        "jobs": len(ran), "server_starts": len(starts), "server_configs": len(configs),
        "server_start_s": total["server_start_s"], "warmup_s": total["warmup_s"], "measure_s": total["measure_s"],
        "other_in_jobs_s": max(0.0, jobs_s - total["server_start_s"] - total["warmup_s"] - total["measure_s"]),
        "jobs_s": jobs_s, "wall_s": wall_s, "parallel": parallel,
        "outside_jobs_s": None if wall_s is None or parallel else max(0.0, wall_s - jobs_s),
        "earlier_jobs": len(earlier),
    }
    return out


def timing_line(t: dict[str, Any]) -> str:
    """The breakdown in one line (for the log at the end of a sweep)."""
    def s(v: Optional[float]) -> str:
        return "?" if v is None else f"{v:.1f} s"

    line = (f"{t['jobs']} job(s): {t['server_starts']} server start(s) for {t['server_configs']} distinct server "
            f"configuration(s) {s(t['server_start_s'])}, warm-up {s(t['warmup_s'])}, measurement {s(t['measure_s'])}, "
            f"other in jobs {s(t['other_in_jobs_s'])}")
    if t["parallel"]:
        line += f"; jobs ran in parallel: {s(t['jobs_s'])} of job time in {s(t['wall_s'])} wall"
    else:
        line += f", outside jobs {s(t['outside_jobs_s'])}; sweep wall {s(t['wall_s'])}"
    if t.get("earlier_jobs"):
        line += f"; {t['earlier_jobs']} job(s) finished in an earlier run of this folder, not counted"
    return line


def job_statuses(sweep_dir: Path) -> dict[str, str]:
    """Every job folder of a sweep (one Hydra made: it has .hydra/) and its status; a job that left no
    result file (its process died) is "missing". Jobs may have run in other processes or machines."""
    out = {}
    for d in sorted(p for p in sweep_dir.iterdir() if p.is_dir()):
        if not (d / ".hydra").is_dir() and not (d / RESULT_FILE).is_file():
            continue
        try:
            job = JobResult.from_json(load_document(d / RESULT_FILE)[1])
            out[job.label or d.name] = job.status or "missing"
        except ResultError:
            out[re.sub(r"^\d+_", "", d.name)] = "missing"  # Hydra's <job number>_<label> folder
    return out


class SweepOutputs(list):
    """The files write_sweep_outputs wrote, with the aggregate and the timing it made them from."""

    aggregate: Aggregate
    timing: dict[str, Any]


def write_sweep_outputs(sweep_dir: Path, wall_s: Optional[float] = None,
                        since: Optional[datetime] = None) -> SweepOutputs:
    """The sweep's aggregate JSON, its Markdown summary and the full report (wall_s, since: sweep_timing)."""
    results: list[JobResult] = []
    agg = collect([sweep_dir], results)  # each result read once: its timing is summed from what collect read
    written = SweepOutputs()
    path = sweep_dir / "sweep.json"
    write_json(path, agg.to_json(), "aggregate")
    written.append(path)
    path = sweep_dir / "summary.md"
    timing = sweep_timing(results, wall_s, since)
    written.aggregate, written.timing = agg, timing
    path.write_text(_env().get_template("sweep.md.j2").render(a=agg, runs=run_tables(agg), timing=timing))
    written.append(path)
    from kvexp.report.render import render_report  # lazy: the report loads matplotlib; a job's summary does not

    written += list(render_report(agg, sweep_dir / "report", validated=True).values())
    return written


def sweep_aggregate(sweep_dir: Path) -> Aggregate:
    """The aggregate a sweep wrote (sweep.json), read and checked as every command reads it."""
    return Aggregate.from_json(load_document(sweep_dir / "sweep.json")[1])


def write_job_report(job_dir: Path) -> tuple[Aggregate, list[Path]]:
    """A single run's report (the sweep's, over one job) in job_dir/report; (its aggregate, the files)."""
    from kvexp.report.render import render_report  # lazy: the report loads matplotlib; a job's summary does not

    agg = collect([job_dir / RESULT_FILE])
    return agg, list(render_report(agg, job_dir / "report", validated=True).values())


def report_is_current(folder: Path, multirun: bool) -> bool:
    """Whether folder/report holds every file of a report written after the newest result (and, for a
    sweep, after sweep.json): not so when a signal cut its rendering short, or it was never rendered."""
    from kvexp.report.render import FILES  # lazy: render loads matplotlib; a job's summary does not

    inputs = [*folder.glob(f"*/{RESULT_FILE}"), folder / "sweep.json"] if multirun else [folder / RESULT_FILE]
    newest = max((p.stat().st_mtime for p in inputs if p.is_file()), default=0.0)
    report = [folder / "report" / name for kind, name in FILES.items() if kind != "pdf" or pdf.support() is None]
    return all(p.is_file() and p.stat().st_mtime >= newest for p in report)


def end_of_run_text(agg: Aggregate) -> str:
    """What the terminal shows when a run or sweep ends: each scenario's verdict, then one aligned row per
    job (its peak throughput and the latencies there, KV bytes per token), unknowns as "—"."""
    lines = [f"verdict: {v.sentence}" for v in verdicts_of(agg)] or ["verdict: no job measured comparable levels"]
    names: dict[str, str] = {}
    for _, scenario_runs in agg.scenarios():  # named within their scenario, where the verdicts name them
        names.update(short_names(scenario_runs))
    return "\n".join(lines + text_table(peak_table(agg.runs, names)))


# ---------------------------------------------------------------- the planner's table (`kvexp plan`)
def _fmt_int(x: Any) -> str:
    return "-" if x is None else f"{x:,}"


def _fmt_levels(rows: list[PlanRow]) -> str:
    out = []
    for r in rows:
        u = r.predicted_kv_usage
        tag = "" if u is None else f" {u:.0%}" if u >= 0.1 or u == 0 else f" {u:.1%}"
        if r.predicts_preemption:
            tag += " preempts"
        elif r.predicts_queueing:
            tag += " queues"
        out.append(f"{r.concurrency}: {tag.strip() or '?'}")
    return ", ".join(out) or "-"


def plan_table(cfgs: list[ExperimentConfig], calibration: dict | None) -> str:
    """A Markdown table of the plan for each config: bytes/token, capacity, blocks, the largest
    concurrency before preemption and the predicted KV usage per level, uncalibrated and calibrated.

    Each config's server is resolved by its adapter without launching anything (a program that is
    not installed is no obstacle to planning); each model's architecture is read once."""
    archs: dict[tuple[str, str], Any] = {}
    lines = [
        "| model | backend | kv | scenario | bytes/token | capacity tokens | KV MiB | blocks | peak GiB | max conc. | "
        "levels (KV usage) | cal. overhead GiB | cal. capacity | cal. max conc. | cal. levels |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    notes: list[str] = []
    for cfg in cfgs:
        kv_dtype = cfg.kv.per_backend.get(cfg.backend.name)
        head = f"| {cfg.model.name} | {cfg.backend.name} | {kv_dtype or cfg.kv.name} | {cfg.scenario.name} "
        if kv_dtype is None:
            lines.append(head + f"| kv={cfg.kv.name} is not available on {cfg.backend.name} |" + " |" * 10)
            continue
        try:
            spec, p = _predicted(cfg, calibration, archs)
        except (ConfigError, ValueError) as e:
            lines.append(head + f"| {e} |" + " |" * 10)
            continue
        conc_key = "max_concurrency_before_preemption" if spec.cache.paged else "max_concurrent_requests"
        max_conc = getattr(p, conc_key)
        c = p.calibrated
        c_conc = None if c is None else getattr(c, conc_key)
        peak = p.predicted_peak_memory_gib
        rss = p.memory_measure == "rss"  # on the CPU: the RSS of the server's processes
        peak_s = "-" if peak is None else f"{peak:.2f}" + (" RSS" if rss else "") + (
            " (does not fit)" if p.fits is False else "")
        lines.append(
            head + f"| {kv_per_token_words(p)} | {_fmt_int(p.capacity_tokens)} | {_fmt_mib(p.kv_cache_bytes)} "
            f"| {_fmt_int(p.blocks)} | {peak_s} | {_fmt_int(max_conc)} | {_fmt_levels(p.levels)} "
            f"| {'-' if c is None else c.overhead_gib} "
            f"| {'-' if c is None else _fmt_int(c.capacity_tokens)} | {_fmt_int(c_conc)} "
            f"| {'-' if c is None else _fmt_levels(c.levels)} |")
        srcs = ", ".join(f"{k}: {v}" for k, v in sorted((p.sources or {}).items()))
        inp = p.inputs or PlanInputs()
        weights = "?" if inp.weights_gib is None else f"{inp.weights_gib:.3f}"
        check = memory.memory_check(p, [], on_gpu=False) if rss else None
        if rss:
            parts = "—" if check is None else memory.parts_words(check)
            where = f"CPU (peak GiB: the RSS of the server's processes, {parts})"
        else:
            gpu_gib = "?" if inp.gpu_gib is None else inp.gpu_gib
            where = f"GPU {cfg.gpu.name or '?'} {gpu_gib} GiB, overhead {inp.overhead_gib} GiB"
        note = f"- {cfg.model.name}/{cfg.backend.name}: {where}, weights {weights} GiB; sources: {srcs}"
        if note not in notes:
            notes.append(note)
    legend = ("max conc.: vLLM requests before preemption; llama.cpp/Ollama requests served at once "
              "(more queue). Levels: concurrency: predicted KV usage.")
    return "\n".join(lines + ["", legend, ""] + notes) + "\n"


def _fmt_mib(b: Optional[float]) -> str:
    return "-" if b is None else f"{b / (1 << 20):,.2f}"


def kv_per_token_words(p: Plan) -> str:
    """A plan's KV bytes per token; for a windowed model the per-token part (the global layers) and the
    fixed part (one sequence's window in the sliding layers), e.g. "3,072 + 15.00 MiB window/seq"."""
    return _fmt_int(p.kv_bytes_per_token) + registry.window_words(p.window_bytes_per_sequence)


def _predicted(cfg: ExperimentConfig, calibration: dict | None, archs: dict[tuple[str, str], Any]) -> tuple[Any, Plan]:
    """A config's launch spec and the planner's prediction for it (one model read per model and backend)."""
    spec = backends.create(cfg, locate=False).spec
    key = (cfg.model.name, cfg.backend.name)
    if key not in archs:
        archs[key] = prediction.model_arch(cfg, spec)
    return spec, Plan.from_json(prediction.predict(cfg, spec, calibration=calibration, arch=archs[key]))


def whatif_table(cfgs: list[ExperimentConfig], calibration: dict | None) -> str:
    """The what-if table of `kvexp plan` over several GPUs: for each config (its gpu= preset), the KV
    tokens and the concurrent requests of its scenario that fit before preemption or queueing,
    uncalibrated and with the overhead this machine measured (kvexp/planning/whatif.py)."""
    archs: dict[tuple[str, str], Any] = {}
    rows: list[tuple[dict[str, Any], Optional[str]]] = []
    problems: list[str] = []
    for cfg in cfgs:
        if cfg.kv.per_backend.get(cfg.backend.name) is None:
            continue  # the plan table above says why
        try:
            spec, p = _predicted(cfg, calibration, archs)
        except (ConfigError, ValueError):
            continue
        gpu = whatif.GPUPreset(cfg.gpu.name or "auto", cfg.gpu.name, cfg.gpu.memory_gib)
        inputs, sources, cache, backend = whatif.from_plan(p, spec.cache)
        row = whatif.what_if(inputs, sources, cache, gpu, calibration, backend=backend)
        rows.append((row, cfg.scenario.name))
        if inputs.weights_gib is None:
            note = f"- {cfg.model.name}/{cfg.backend.name}: weights unknown (set model.weights_gib or the model's file)"
            if note not in problems:
                problems.append(note)
        if gpu.memory_gib is None:
            note = f"- gpu={gpu.key}: memory unknown (NVML saw no GPU; choose a preset or gpu.memory_gib)"
            if note not in problems:
                problems.append(note)
    rows.sort(key=lambda rs: (rs[0]["gpu_gib"] or 0, rs[0]["model"] or "", rs[0]["backend"], str(rs[0]["kv_dtype"]),
                              rs[1] or ""))
    return whatif.markdown_table(rows) + ("\n" + "\n".join(problems) + "\n" if problems else "")
