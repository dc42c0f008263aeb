"""Resuming a run or sweep folder: the command line that measures what it lacks, what is already
finished there, and its report rendered again when a signal cut it short."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from kvexp.app.compose import compose_all, one_line_error
from kvexp.app.interrupts import quiet_on_signals
from kvexp.app.preflight import finished_jobs, quote_path
from kvexp.core.config import ConfigError
from kvexp.results.store import ResultError, load_document


def resumable(folder: Path) -> bool:
    """Whether folder holds what resume_args reads (Hydra writes it as its first job starts)."""
    return (folder / "multirun.yaml").is_file() or (folder / ".hydra" / "hydra.yaml").is_file()


def resume_args(folder: Path) -> list[str]:
    """The command line that runs the sweep (or single run) saved in `folder` again into the same
    folder with resume=true, from the overrides Hydra saved there (multirun.yaml, .hydra/hydra.yaml)."""
    if not folder.is_dir():
        raise ConfigError(f"{folder}: no such folder" if not folder.exists() else f"{folder}: not a folder")
    multirun = (folder / "multirun.yaml").is_file()
    saved = folder / ("multirun.yaml" if multirun else ".hydra/hydra.yaml")
    if not saved.is_file():
        raise ConfigError(f"{folder}: not a kvexp sweep or run folder (no multirun.yaml or .hydra/hydra.yaml)")
    try:
        overrides: Any = OmegaConf.to_container(OmegaConf.load(saved).hydra.overrides, resolve=False)
        args = [*overrides["hydra"], *overrides["task"]]
        if not all(isinstance(a, str) for a in args):
            raise ValueError("not a list of strings")
    except Exception as e:
        raise ConfigError(f"{saved}: hydra.overrides: cannot read the saved overrides "
                          f"({one_line_error(e)})") from None
    dir_key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    ours = {"resume", "hydra.mode", "hydra.sweep.dir", "hydra.run.dir"}
    kept = [a for a in args if a.split("=", 1)[0].lstrip("+~") not in ours]
    edited_result(folder, multirun)
    return (["-m"] if multirun else []) + kept + [f"{dir_key}={quote_path(folder.resolve())}", "resume=true"]


def edited_result(folder: Path, multirun: bool) -> None:
    """Refuse (ConfigError, one line) a folder holding a result whose config no longer matches its
    config_hash: it was edited after it was written, and neither its levels nor its status can be trusted."""
    for p in sorted(folder.glob("*/result.json")) if multirun else [folder / "result.json"]:
        if not p.is_file():
            continue
        try:
            load_document(p)
        except ResultError as e:
            if "$.config_hash" in str(e):
                raise ConfigError(f"{e}; resume refuses this folder") from None


def finish_report(folder: Path, multirun: bool) -> int:
    """Render the report of a finished run or sweep again when it is missing or older than its results (a
    signal cut its rendering short); exit status 1 when that fails."""
    from kvexp.report.summary import report_is_current, write_job_report, write_sweep_outputs

    if report_is_current(folder, multirun):
        return 0

    def render() -> int:
        try:
            written = write_sweep_outputs(folder) if multirun else write_job_report(folder)[1]
        except Exception as e:  # one line: the results themselves stay as they are
            print(f"kvexp resume: cannot render the report of {folder}: {str(e).splitlines()[0] if str(e) else e}",
                  file=sys.stderr)
            return 1
        print(f"kvexp: its report was missing or older than its results; wrote {len(written)} files in "
              f"{folder / 'report'}", file=sys.stderr)
        return 0
    return quiet_on_signals("resume", render)


def finished(folder: Path, run_argv: list[str]) -> Optional[str]:
    """What a resume would find finished (e.g. "its 4 jobs are finished (3 complete, 1 skipped)"), or
    None when something is left to measure or the folder's spec cannot be composed (the resume itself
    then says why)."""
    multirun = "-m" in run_argv
    try:
        jobs = compose_all([a for a in run_argv if not a.startswith("-")])
    except ConfigError:
        return None
    return finished_jobs(folder.resolve(), multirun, [cfg for _, cfg in jobs])
