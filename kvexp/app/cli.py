"""The command line: the subcommands and the run itself (Hydra's entry point).

    python -m kvexp [-m] [group=option ...] [key=value ...]   run (or sweep) experiments
    python -m kvexp resume DIR                                 finish an interrupted sweep or run
    python -m kvexp validate PATH...                           check result files (folders: every result.json)
    python -m kvexp report PATH... [--out DIR] [--title T]     comparison report from results
    python -m kvexp results PATH... [--csv [OUT]]              one row per level: a table, or comparison.csv
    python -m kvexp plan [overrides]                           KV-capacity planner table
    python -m kvexp install [llamacpp|vllm|ollama|smollm2|gemma3] [--force] [--cpu|--cuda]   one-time installs
    python -m kvexp cleanup                                    stop servers a killed kvexp left running
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from kvexp.app import stdout
from kvexp.app.compose import (backend_only_keys, check, compose_all, default_folder, drop_backend_only,
                               hydra_argv, ignored_keys_note, kv_choices, printable, refuse_repeats,
                               refuse_unread, safe_name, sweep_backends, sweep_overrides, to_experiment)
from kvexp.app.interrupts import interrupted
from kvexp.app.resume import finish_report, finished, resumable, resume_args
from kvexp.core.config import ConfigError, KVConfig, job_label
from kvexp.core.paths import data_dir

if TYPE_CHECKING:
    from kvexp.metrics.levels import Level

log = logging.getLogger("kvexp")


# ---------------------------------------------------------------- the experiment (Hydra app)
@dataclass
class _Sweep:
    """What one `python -m kvexp` invocation knows while its jobs run (passed to the Hydra task
    function by closure, never kept in module globals)."""

    folder: Path  # the run folder, or the sweep folder of a multirun
    multirun: bool
    pool: Any  # backends.pool.ServerPool: a server kept for an identical next job
    failed: list[str] = field(default_factory=list)
    backend_only: tuple[str, ...] = ()  # backend keys set only for the jobs whose backend declares them


def run_experiment(argv: list[str]) -> int:
    """Run (or sweep) the jobs argv describes. SIGINT/SIGTERM stop every server kvexp started, keep what
    was measured and exit 128+signal with the command that resumes."""
    from kvexp.backends import process
    from kvexp.backends.pool import ServerPool

    try:
        argv = hydra_argv(argv)
    except ConfigError as e:
        return _refused(e)
    multirun = any(a in ("-m", "--multirun") for a in argv)
    given = [a for a in argv if not a.startswith("-")]
    overrides, backend_only = backend_only_keys(given)
    argv = [overrides[given.index(a)] if not a.startswith("-") else a for a in argv]
    handlers = process.raise_on_signals()
    sweep: Optional[_Sweep] = None
    try:
        from kvexp.backends import launched

        launched.report_leftovers()
        try:
            from kvexp.app import preflight

            stray = [a for a in overrides if "=" not in a and not a.startswith("~")]
            if stray:
                raise ConfigError(f"{stray[0]}: neither a command ({', '.join(SUBCOMMANDS)}) nor an override "
                                  "key=value")
            refuse_repeats(overrides)
            kvs = kv_choices()
            jobs = compose_all(overrides)
            refuse_unread(overrides, jobs)
            skipped = []
            for _, cfg in jobs:
                reason = check(cfg, kvs, multirun)
                if reason is None:
                    preflight.check_job(cfg)
                else:
                    skipped.append((job_label(cfg), reason))
            argv, folder = preflight.prepare(argv, overrides, jobs, default_folder(jobs[0][0], multirun))
        except ConfigError as e:
            return _refused(e)
        if folder is not None:
            _announce(jobs, skipped, backend_only, overrides)
        sweep = _Sweep(folder=folder or Path.cwd(), multirun=multirun, pool=ServerPool(),
                       backend_only=tuple(sorted(backend_only)))
        import hydra

        @hydra.main(config_path=str(data_dir("conf")), config_name="config", version_base="1.3")
        def app(node: Any) -> None:
            _task(node, sweep, kvs)

        sys.argv = [sys.argv[0], *argv]
        app()
        process.raise_if_interrupted()
    except KeyboardInterrupt as e:
        process.stop_all()
        name = str(e) or "SIGINT"
        if sweep is None or not resumable(sweep.folder):  # Hydra had not yet written what a resume reads
            return interrupted(f"kvexp: interrupted by {name} before any job started: nothing was measured", name)
        return interrupted(f"kvexp: interrupted by {name}: servers stopped, finished levels saved; resume with: "
                           f"python -m kvexp resume {shlex.quote(str(sweep.folder))}", name)
    finally:
        if sweep is not None:
            sweep.pool.release()
        from kvexp.app.preflight import unlock_all

        unlock_all()
        process.restore_signals(handlers)
    failed = _failed_jobs(sweep)
    if failed:
        print(f"kvexp: {len(failed)} job(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _announce(jobs: list[Any], skipped: list[tuple[str, str]], backend_only: dict[str, list[str]],
              overrides: list[str]) -> None:
    """Before the first job: the keys set for some backends only, and the jobs that will be recorded
    as skipped (an unsupported backend/kv pair), each with its reason."""
    from kvexp.app.preflight import download_notes

    for line in download_notes(jobs):
        print(f"kvexp: {line}", file=sys.stderr)
    if backend_only:
        backends = sweep_backends(sweep_overrides(overrides))
        for line in ignored_keys_note(backend_only, backends):
            print(f"kvexp: {line}", file=sys.stderr)
    if skipped:
        print(f"kvexp: {len(skipped)} of {len(jobs)} jobs cannot run and are recorded as skipped "
              "(unsupported=error refuses them instead):", file=sys.stderr)
        for label, reason in skipped:
            print(f"kvexp:   skipped {label}: {reason}", file=sys.stderr)


def _failed_jobs(sweep: _Sweep) -> list[str]:
    """The jobs that failed: those this process saw fail, and (a multirun's jobs may have run in other
    processes or machines: submitit, Ray) those whose folder says failed or holds no result."""
    from kvexp.report.summary import job_statuses

    failed = list(sweep.failed)
    if sweep.multirun:
        try:
            seen = set(failed) | {safe_name(x) for x in failed}
            failed += [label for label, status in job_statuses(sweep.folder).items()
                       if status in ("failed", "missing") and label not in seen]
        except OSError as e:
            log.error("sweep: could not read the job folders of %s: %s", sweep.folder, e)
    return failed


def _task(node: Any, sweep: _Sweep, kvs: dict[str, KVConfig]) -> None:
    from hydra.core.hydra_config import HydraConfig

    from kvexp.measure.runner import run_job, unrun_result
    from kvexp.report.summary import write_job_summary

    out_dir = Path(HydraConfig.get().runtime.output_dir)
    cfg = drop_backend_only(to_experiment(node), sweep.backend_only)
    cfg.output_dir = str(out_dir)
    label = job_label(cfg)
    try:
        reason = check(cfg, kvs, sweep.multirun)
        if reason:
            log.warning("%s: skipped: %s", label, reason)
            result = unrun_result(cfg, out_dir, reason)
        else:
            log.info("%s: starting (output in %s)", label, out_dir)
            from kvexp.app.progress import make_observer

            observer = make_observer(label, LogObserver(label), cfg.scenario.repeats)  # live display on a terminal
            result = run_job(cfg, out_dir, observer, sweep.pool, in_sweep=sweep.multirun)
        write_job_summary(job := result, out_dir)
        log.info("%s: %s -> %s", label, job.status, out_dir / "result.json")
        if not sweep.multirun:
            _single_report(out_dir)
        if job.status == "failed" or (job.levels and all(lv.failed for lv in job.levels)):
            sweep.failed.append(label)  # nothing usable was measured: the run exits non-zero
            log.error("%s: nothing usable was measured: %s", label, job.status_reason or job.status)
    except Exception as e:
        if not _is_known(e):
            raise  # a bug in kvexp: keep the traceback
        sweep.failed.append(label)
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        log.error("%s: failed: %s (see %s)", label, first, out_dir)


def _single_report(out_dir: Path) -> None:
    """A single run gets the sweep's report over its one job, and the end-of-run verdict and table."""
    from kvexp.report.summary import end_of_run_text, write_job_report

    try:
        agg, written = write_job_report(out_dir)
        for p in written:
            log.info("report: wrote %s", p)
        print(end_of_run_text(agg), flush=True)
    except Exception as e:  # the measurements are on disk whatever happens here
        log.error("report: could not render %s: %s", out_dir, str(e).splitlines()[0] if str(e) else e)


def _is_known(e: BaseException) -> bool:
    import aiohttp

    from kvexp.backends.base import BackendError
    from kvexp.results.store import ResultError

    return isinstance(e, (BackendError, ConfigError, ResultError, OSError, aiohttp.ClientError, RuntimeError))


class LogObserver:
    """Plain log lines per level (the measurement code never formats output itself)."""

    def __init__(self, label: str):
        self.label = label

    def level_started(self, level: float, total: int, repeat: int) -> None:
        log.info("%s: level %g: %d requests%s", self.label, level, total, f" (repeat {repeat + 1})" if repeat else "")

    def request_done(self, record: Any) -> None:
        pass

    def level_done(self, level: float, s: Level) -> None:
        from kvexp.metrics.registry import UNKNOWN, format_value

        fig = {k: UNKNOWN if s.value(k) is None else format_value(k, s.value(k))
               for k in ("throughput_tok_s", "ttft_p50_ms", "tpot_p50_ms")}
        log.info("%s: level %g: %s tok/s, TTFT p50 %s ms, TPOT p50 %s ms, errors %d/%d%s", self.label, level,
                 fig["throughput_tok_s"], fig["ttft_p50_ms"], fig["tpot_p50_ms"], s.errors, s.requests,
                 "" if s.status == "ok" else " (FAILED)")


try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover
    Callback = object  # type: ignore


class SweepCallback(Callback):  # type: ignore[misc]
    """At the end of a multirun: summarise the sweep from what every job wrote (jobs may have run in
    other processes or machines: submitit, Ray) and log where the sweep's time went. It keeps no state
    beyond the sweep's start time; the exit status is counted from the job folders by run_experiment."""

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        import time
        from datetime import datetime, timezone

        self._t0 = time.monotonic()
        self._since = datetime.now(timezone.utc).replace(tzinfo=None)  # a resumed sweep's earlier jobs finished before

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        import time

        from kvexp.report.summary import end_of_run_text, timing_line, write_sweep_outputs

        sweep_dir = Path(config.hydra.sweep.dir)
        wall = time.monotonic() - self._t0 if hasattr(self, "_t0") else None
        since = getattr(self, "_since", None)
        try:
            written = write_sweep_outputs(sweep_dir, wall, since)
            for p in written:
                log.info("sweep: wrote %s", p)
            log.info("sweep: %s", timing_line(written.timing))  # what it read: each result is read once
            print(end_of_run_text(written.aggregate), flush=True)
        except Exception as e:  # the measurements are on disk whatever happens here
            log.error("sweep: could not summarise %s: %s", sweep_dir, str(e).splitlines()[0] if str(e) else e)


# ---------------------------------------------------------------- subcommands
class _Parser(argparse.ArgumentParser):
    """argparse with a one-line usage error and exit status 1, like every other kvexp error."""

    def error(self, message: str) -> Any:
        self.exit(1, f"{self.prog}: {message}\n")


def cmd_resume(argv: list[str]) -> int:
    ap = _Parser(prog="kvexp resume", description="Finish an interrupted sweep or run in its own folder: "
                 "complete jobs are kept, finished levels are kept, only what is missing is measured.")
    ap.add_argument("folder", type=Path, help="the sweep folder (outputs/sweeps/...) or run folder")
    args = ap.parse_args(argv)
    try:
        run_argv = resume_args(args.folder)
    except ConfigError as e:
        return _refused(e)
    done = finished(args.folder, run_argv)
    if done:
        print(f"kvexp: nothing to resume in {args.folder}: {done}", file=sys.stderr)
        return finish_report(args.folder, "-m" in run_argv)
    print(f"kvexp: resuming: python -m kvexp {' '.join(shlex.quote(a) for a in run_argv)}", file=sys.stderr)
    return run_experiment(run_argv)


def _refused(e: Exception) -> int:
    """A refused command: its one line (what was typed quoted harmlessly), exit status 1."""
    print(f"kvexp: {printable(str(e))}", file=sys.stderr)
    return 1


def cmd_validate(argv: list[str]) -> int:
    from kvexp.results.store import RESULT_FILE, once, result_files
    from kvexp.results.validate import check_file

    ap = _Parser(prog="kvexp validate", description="Validate kvexp result files (and other tools' result "
                 "files kvexp reads); a folder: every result.json under it, one line per file; a file named: "
                 "a line per problem. Exit 1 if any is invalid.")
    ap.add_argument("files", nargs="+", type=Path, help="files, or folders (every result.json under them)")
    args = ap.parse_args(argv)
    bad = 0
    seen: set[str] = set()  # a file named twice (itself and in its folder) is validated once
    for given in args.files:
        found = result_files(given) if given.is_dir() else [given]
        if not found:
            print(f"{printable(str(given))}: no {RESULT_FILE} found in this folder")
            bad += 1
        for f in once(found, seen):
            errs = check_file(f)
            if given.is_dir() and len(errs) > 1:  # a folder: one line per file, the file itself has them all
                errs = [f"{errs[0]} (and {len(errs) - 1} more: kvexp validate {shlex.quote(str(f))})"]
            for e in errs:
                print(printable(e))  # a file's name may hold what would drive the terminal
            if errs:
                bad += 1
            else:
                print(f"{printable(str(f))}: valid")
    return 1 if bad else 0


def cmd_report(argv: list[str]) -> int:
    from kvexp.app.interrupts import cut_short, quiet_on_signals

    ap = _Parser(prog="kvexp report", description="Render a comparison report.")
    ap.add_argument("paths", nargs="+", type=Path, help="sweep folders, job folders or result files")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: outputs/reports/<time>)")
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    from kvexp.results.guards import hidden_char

    if len(args.title or "") > MAX_TITLE_CHARS:  # it heads every page of the PDF
        print(f"kvexp: report --title: {len(args.title):,} characters; allowed at most {MAX_TITLE_CHARS}",
              file=sys.stderr)
        return 1
    hidden = hidden_char(args.title or "")
    if hidden is not None:
        print(f"kvexp: report --title {args.title!r} holds {args.title[hidden]!r} at position {hidden}: it heads "
              "every page, so only printable characters are allowed", file=sys.stderr)
        return 1
    args.out = args.out or Path("outputs/reports") / _stamp()
    made = [] if args.out.exists() else [args.out]  # a signal removes the folder it made, half-written
    return quiet_on_signals("report", lambda: _report(args), lambda: cut_short(made, args.out))


def _report(args: argparse.Namespace) -> int:
    from kvexp.analysis.aggregate import collect
    from kvexp.report.render import render_report
    from kvexp.results.store import ResultError

    try:
        agg = collect(args.paths)
    except ResultError as e:
        return _refused(e)
    out = args.out
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"kvexp: --out {out}: cannot make this folder: {e.strerror}", file=sys.stderr)
        return 1
    from kvexp.results.validate import ValidationFailed

    try:
        written = render_report(agg, out, title=args.title, validated=True)  # collect checked it
    except ValidationFailed as e:  # what the report would write does not hold to its schema: name the field
        print(f"kvexp: report: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a full disk, a folder taken away while it writes
        print(f"kvexp: report: cannot write {e.filename or out}: {e.strerror or e}", file=sys.stderr)
        return 1
    for kind, path in written.items():
        print(f"{kind}: {path}")
    for problem in getattr(written, "problems", []):
        print(f"kvexp: {problem}", file=sys.stderr)
    return 0


def cmd_plan(argv: list[str]) -> int:
    from kvexp.app import helptext
    from kvexp.backends import adapter_class
    from kvexp.planning import calibration
    from kvexp.report.summary import plan_table, whatif_table

    if helptext.wants_help(argv):
        print(helptext.plan_help())
        return 0
    try:
        argv, gpus = whatif_args(argv)
        flag = next((a for a in argv if a.startswith("-") and a not in ("-m", "--multirun")), None)
        if flag is not None:  # Hydra's flags (--cfg, --info, ...) belong to a run, not to the planner
            raise ConfigError(f"plan: {flag}: not a flag plan takes; allowed: overrides (group=option, "
                              "group.key=value), --gpus and -m")
        refuse_repeats([a for a in argv if not a.startswith("-")])
        cfgs = [cfg for _, cfg in compose_all([a for a in argv if a not in ("-m", "--multirun")])]
        from kvexp.app import preflight

        kvs = kv_choices()
        for cfg in cfgs:  # a run's checks (a job a sweep would skip is planned all the same), and a model file
            check(cfg, kvs, multirun=True, serves=False)
            if getattr(cfg.model, adapter_class(cfg.backend.name).served_field(cfg.model), None):
                preflight.check_model_file(cfg)
    except (ConfigError, ValueError) as e:
        return _refused(e)
    _gpu_from_nvml(cfgs)
    table = calibration.load()
    print(plan_table(cfgs, table))
    if gpus or len({(c.gpu.name, c.gpu.memory_gib) for c in cfgs}) > 1:
        print("What if: the same configurations on each GPU\n")
        print(whatif_table(cfgs, table))
    return 0


def _gpu_from_nvml(cfgs: list[Any]) -> None:
    """gpu=auto plans for this machine's GPU, as a run does: its name and memory from NVML (none: unknown)."""
    from kvexp.measure.gpu import gpu_info

    for cfg in cfgs:
        if cfg.gpu.name is None and cfg.gpu.memory_gib is None:
            gi = gpu_info(cfg.gpu.index, quiet=True)
            cfg.gpu.name, cfg.gpu.memory_gib = gi.name, gi.memory_gib


def whatif_args(argv: list[str]) -> tuple[list[str], bool]:
    """`--gpus all|KEY,...` -> a gpu= override of those conf/gpu presets (True: a what-if was asked)."""
    from kvexp.planning import whatif

    out, asked = list(argv), False
    for i, a in enumerate(argv):
        if a == "--gpus" or a.startswith("--gpus="):
            value = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
            keys = [g.key for g in whatif.parse_gpus(value, whatif.gpu_presets())]
            drop = {i} if "=" in a else {i, i + 1}
            out = [x for j, x in enumerate(argv) if j not in drop and not x.startswith("gpu=")]
            out.append("gpu=" + ",".join(keys))
            asked = True
            break
    return out, asked


def cmd_results(argv: list[str]) -> int:
    from kvexp.analysis.aggregate import collect
    from kvexp.app.table import results_table
    from kvexp.report.tables import csv_text
    from kvexp.results.store import ResultError

    ap = _Parser(prog="kvexp results", description="Every level of any mix of result files (kvexp sweeps, jobs, "
                 "result files, the reference document, vLLM bench serve / GuideLLM / AIPerf files): an aligned "
                 "table of the key figures, or with --csv every column of comparison.csv, one row per level.")
    ap.add_argument("paths", nargs="+", type=Path, help="sweep folders, job folders or result files")
    ap.add_argument("--csv", nargs="?", const="-", default=None, metavar="OUT",
                    help="CSV instead of the table: to OUT, or to standard output when OUT is not given")
    args = ap.parse_args(argv)
    try:
        agg = collect(args.paths)
    except ResultError as e:
        return _refused(e)
    if args.csv is None:
        sys.stdout.write(results_table(agg))
        return 0
    text = csv_text(agg)
    if args.csv == "-":
        sys.stdout.write(text)
        return 0
    from kvexp.core.paths import atomic_write

    out = Path(args.csv)
    if not args.csv or out.is_dir():
        print(f"kvexp: --csv {args.csv!r}: a folder, not a file name: give the CSV file to write", file=sys.stderr)
        return 1
    if out.exists() and out.suffix.lower() != ".csv":  # result.json, requests.jsonl: what was measured
        print(f"kvexp: --csv {out}: exists and is not a .csv file; refusing to replace it (give a new name, "
              "or one ending in .csv)", file=sys.stderr)
        return 1
    try:
        atomic_write(out, text)
    except OSError as e:
        print(f"kvexp: --csv {out}: cannot write: {e.strerror}", file=sys.stderr)
        return 1
    print(f"csv: {out}")
    return 0


def cmd_install(argv: list[str]) -> int:
    from kvexp.app.installer import cmd_install as install  # the install stack loads only for install

    return install(argv)


def cmd_cleanup(argv: list[str]) -> int:
    from kvexp.backends import launched

    ap = _Parser(prog="kvexp cleanup", description="Stop the servers a kvexp that has ended left running "
                 "(found from kvexp's record of the servers it launched).")
    ap.add_argument("--dry-run", action="store_true", help="only list them")
    args = ap.parse_args(argv)
    found = launched.leftovers()
    if not found:
        print("kvexp cleanup: no server left running by an ended kvexp")
        return 0
    failed = 0
    for r in found:
        if args.dry_run:
            print(f"kvexp cleanup: left running: {r.describe()}")
        elif launched.stop(r):
            print(f"kvexp cleanup: stopped {r.describe()}")
        else:
            failed += 1
            print(f"kvexp cleanup: could not stop {r.describe()}", file=sys.stderr)
    return 1 if failed else 0


def _stamp() -> str:
    from datetime import datetime

    return datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


MAX_TITLE_CHARS = 200

SUBCOMMANDS: dict[str, Callable[[list[str]], int]] = {
    "validate": cmd_validate, "report": cmd_report, "plan": cmd_plan, "install": cmd_install,
    "resume": cmd_resume, "results": cmd_results, "cleanup": cmd_cleanup,
}


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in SUBCOMMANDS:
            from kvexp.app.interrupts import quiet_on_signals

            command, rest = SUBCOMMANDS[argv[0]], argv[1:]
            return quiet_on_signals(argv[0], lambda: command(rest))  # SIGINT, TERM or HUP: one line
        if "--version" in argv:
            from kvexp.core import __version__

            if len(argv) > 1:  # it would run nothing of what the rest asks for
                print(f"kvexp: --version takes no other argument (given: {printable(' '.join(argv))})", file=sys.stderr)
                return 1
            print(f"kvexp {__version__}")
            return 0
        from kvexp.app import helptext

        if helptext.wants_help(argv):
            print(helptext.main_help())
            return 0
        return run_experiment(argv)
    except KeyboardInterrupt as e:  # a signal before the command put its own handlers in place
        name = str(e) if str(e) in signal.Signals.__members__ else "SIGINT"
        return interrupted(f"kvexp{' ' + argv[0] if argv and argv[0] in SUBCOMMANDS else ''}: interrupted by {name}",
                           name)
    except OSError as e:  # a path the system refuses (a name over 255 bytes, a loop of links, ...): one line
        if e.filename is None:
            raise
        print(f"kvexp: {printable(str(e.filename))}: {e.strerror}", file=sys.stderr)
        return 1


def entry() -> None:
    from kvexp.backends.process import HANDLED, process_exits_after_command, repeats_ignored

    process_exits_after_command()
    try:
        stdout.guard()
        code = main()
    except SystemExit as e:  # a closed stdout, install's failures, argparse's usage errors and --help: a signal
        if e.code is not None and not isinstance(e.code, int):  # in that exit is ignored, as after any command
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    code = stdout.status(code)
    ended_by_signal = repeats_ignored()
    for sig in HANDLED:  # the command is over: a signal now would only kill the exit, silently, with its status
        signal.signal(sig, signal.SIG_IGN)
    if ended_by_signal:  # Python's own exit would put back the default handlers, and a Ctrl-C pressed
        logging.shutdown()  # again then would kill kvexp with SIGINT's status
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
