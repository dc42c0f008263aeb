"""A sweep's aggregate document: every run's result, other tools' levels, recommendations, calibration
rows, gathered from any mix of sweep folders, job folders, result files and aggregates."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Optional

from kvexp.analysis.card import kv_cards
from kvexp.analysis.recommend import recommendations
from kvexp.analysis.verdict import Verdict, verdicts
from kvexp.core import __version__
from kvexp.planning.calibration import calibration_rows
from kvexp.results import foreign
from kvexp.results.blocks import CalibrationRow, Environment
from kvexp.results.documents import JobResult
from kvexp.results.runs import Aggregate, Run
from kvexp.results.store import ResultError, find_results, load_all
from kvexp.results.validate import SCHEMA_VERSION, validate_document


def collect(paths: Iterable[Path], results: Optional[list[JobResult]] = None) -> Aggregate:
    """One aggregate from any mix of sweep folders, job folders, result files and aggregates, each file read
    once; its verdicts, recommendations and KV cards computed once, here, for every output to read
    (interpretation). `results`: a list that receives the job results read (a sweep's timing reads them)."""
    runs: list[Run] = []
    configs: list[Optional[dict[str, Any]]] = []  # each run's config, where its result is read here
    calibration: list[CalibrationRow] = []
    planner = None
    results = [] if results is None else results
    gpu, gpu_gib, environment_ = None, None, None
    foreign_levels: list[Any] = []
    for path, kind, doc in load_all(find_results(paths)):  # (in parallel where there are many)
        if kind == "foreign":
            foreign_levels += _foreign_levels(path, doc)
        elif kind == "aggregate":
            agg = Aggregate.from_json(doc)
            runs += agg.runs
            configs += [None] * len(agg.runs)
            calibration += agg.calibration or []
            planner = planner or agg.planner
            gpu, gpu_gib = gpu or agg.gpu, gpu_gib or agg.gpu_gib
            environment_ = environment_ or (agg.environment.to_json() if agg.environment is not None else None)
        else:
            job = JobResult.from_json(doc)
            results.append(job)
            runs.append(run_of(job, str(path)))
            configs.append(job.config)
            environment_ = environment_ or job.environment
            gpu = gpu or job.gpu.name
            gpu_gib = gpu_gib or job.gpu.memory_gib
    distinct_labels(runs, configs)
    if foreign_levels:
        runs += _foreign_runs(foreign_levels, runs)
    if results:
        calibration += [CalibrationRow.from_json(row) for row in calibration_rows(results)]
    env = None if environment_ is None else Environment.from_json(environment_)
    agg = Aggregate(schema_version=SCHEMA_VERSION, kind="kvexp.aggregate", kvexp_version=__version__,
                    environment=env, gpu=gpu, gpu_gib=gpu_gib,
                    run_dates=sorted({r.started_at for r in runs if r.started_at}), runs=runs,
                    calibration=calibration, planner=planner)
    said = interpretation(agg)
    agg.recommendations, agg.verdicts, agg.kv_cards = said["recommendations"], said["verdicts"], said["kv_cards"]
    validate_document(agg.to_json(), "aggregate", where="aggregate")
    return agg


def interpretation(agg: Aggregate) -> dict[str, list[dict[str, Any]]]:
    """{recommendations, verdicts (as JSON), kv_cards}: those the aggregate holds (collect computed them),
    else computed now (an aggregate built by hand, or a document from before they were recorded)."""
    recs = agg.recommendations if isinstance(agg.recommendations, list) else recommendations(agg)
    said = agg.verdicts if isinstance(agg.verdicts, list) else [v.to_json() for v in verdicts(agg)]
    cards = agg.kv_cards if isinstance(agg.kv_cards, list) else kv_cards(agg)
    return {"recommendations": recs, "verdicts": said, "kv_cards": cards}


def verdicts_of(agg: Aggregate) -> list[Verdict]:
    """The aggregate's verdicts (interpretation), as Verdicts."""
    return [Verdict.from_json(v) for v in interpretation(agg)["verdicts"]]


def run_of(result: JobResult, source: str | None = None) -> Run:
    """A job result as one run of the aggregate shape."""
    return Run.of_job(result, source)


UNTOLD = ("output_dir", "resume", "label")  # config keys that do not tell two measurements apart


def distinct_labels(runs: list[Run], configs: list[Optional[dict[str, Any]]]) -> None:
    """Runs that share a label (a sweep over a key the label does not name, such as backend.threads=1,2,
    or one label= for every job) get the settings that tell them apart added to it, e.g.
    `llamacpp-tiny-fp16-smoke (threads=2)`; runs whose configs differ in nothing get a number."""
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(runs):
        groups.setdefault(r.label, []).append(i)
    taken = set(groups)
    for label, idx in groups.items():
        if len(idx) < 2:
            continue
        flat = [None if configs[i] is None else _flat(configs[i]) for i in idx]  # (an aggregate's run: none)
        known = [f for f in flat if f is not None]
        keys = sorted(k for k in set().union(*known) if not k.startswith(UNTOLD)
                      and len({repr(f.get(k)) for f in known}) > 1)
        for n, (i, f) in enumerate(zip(idx, flat), start=1):
            tag = ", ".join(f"{k.rsplit('.', 1)[-1]}={f.get(k)}" for k in keys[:3])[:200] if f else ""
            new = f"{label} ({tag or n})"
            new = new if new not in taken else f"{label} ({tag + ', ' if tag else ''}#{n})"
            runs[i].label = new
            taken.add(new)


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _foreign_levels(path: Path, doc: Any) -> list[Any]:
    try:
        return foreign.levels_of(doc, str(path))
    except foreign.ForeignFormatError as e:
        raise ResultError(f"{path}: {e}") from None


def _foreign_runs(levels: list[Any], runs: list[Run]) -> list[Run]:
    """Other tools' levels as runs, each joining the scenario of kvexp's runs with the same prompt and
    output length, with a label no other run has."""
    try:
        new = foreign.runs_of(levels)
    except foreign.ForeignFormatError as e:
        raise ResultError(str(e)) from None
    taken = {r.label for r in runs}
    for r in foreign.join_scenarios(new, runs):
        label, n = r.label, 2
        while r.label in taken:
            r.label, n = f"{label} ({n})", n + 1
        taken.add(r.label)
    return new
