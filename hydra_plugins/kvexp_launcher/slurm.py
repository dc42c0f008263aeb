"""`hydra/launcher=kvexp_slurm`: hydra-submitit-launcher's Slurm launcher, with kvexp's settings of
`submitit_slurm` (conf/hydra/launcher/submitit_slurm.yaml), that waits for every job of a sweep and
turns a job that did not finish (cancelled with scancel, past its time limit, its node lost, or failed)
into one line naming it, recorded in that job's result.json (status failed, with Slurm's state), instead
of an exception that ends the sweep: the other jobs' results stay, the sweep's report is written, kvexp
exits 1 (a job says failed), and `python -m kvexp resume` runs again only what is missing: a job
cancelled while still pending gets a failed result of its own, and a resume does not submit the jobs
that are already finished."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import open_dict

try:
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
except ImportError:  # hydra-submitit-launcher (kvexp's `cluster` extra) is not installed: nothing to extend
    SlurmLauncher = None

log = logging.getLogger("kvexp")
TARGET = "hydra_plugins.kvexp_launcher.slurm.KvexpSlurmLauncher"
# Slurm's states of a job that was stopped before it finished (squeue/sacct JOB STATE CODES)
CUT_SHORT = ("CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "DEADLINE", "BOOT_FAIL")


def _why(job: Any) -> str:
    """One line: what Slurm says became of a job stopped before it finished, and where its output is."""
    state = str(getattr(job, "state", "") or "UNKNOWN")
    what = "cancelled" if state.startswith("CANCELLED") else "ended before it finished"
    return f"{what} (Slurm job {job.job_id}: {state}; its output: {job.paths.stderr})"


@contextlib.contextmanager
def _stderr_held() -> Iterator[None]:
    """What child processes write to standard error meanwhile, held back: written out if the block ends
    normally, dropped if it raises (its caller says why in one line)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        held.seek(0)
        os.write(2, held.read())


def _refusal(stderr: str) -> str:
    """sbatch's reason, in one line: its last `error:` line (`Batch job submission failed: Invalid partition
    name specified`), else its last line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    said = [ln for ln in lines if "error:" in ln or "fatal:" in ln]
    return (said or lines or ["sbatch failed"])[-1]


def _drop_unsubmitted(sweep_dir: Path) -> None:
    """A sweep folder that Slurm's refusal left holding only what Hydra and submitit wrote before the
    submission (multirun.yaml, .submitit/) is removed; one holding anything else (a resumed sweep's results,
    the user's files) is left as it is."""
    import shutil

    made = {"multirun.yaml", ".submitit"}
    if sweep_dir.is_dir() and {p.name for p in sweep_dir.iterdir()} <= made:
        shutil.rmtree(sweep_dir, ignore_errors=True)


def _failed(ret: JobReturn, job: Any) -> str:
    first = (str(ret._return_value).splitlines() or [type(ret._return_value).__name__])[0]
    return f"failed: {first} (Slurm job {job.job_id}; its output: {job.paths.stderr})"


def _record(folder: Path, why: str) -> str | None:
    """Say in the job's result.json why it ended, unless it says complete or skipped; the job's label
    (None when the job left no readable result)."""
    from kvexp.results.documents import JobResult  # kvexp only on a failure
    from kvexp.results.store import RESULT_FILE, ResultError, load_document, write_json

    try:
        job = JobResult.from_json(load_document(folder / RESULT_FILE)[1])
        if job.status not in ("complete", "skipped"):
            job.update(status="failed", status_reason=why)
            write_json(folder / RESULT_FILE, job.to_json(), "result")
        return str(job.label)
    except (ResultError, OSError):
        return None


def _experiment(cfg: Any, folder: Path) -> Any:
    """kvexp's typed config of a job from its Hydra config (as the job's own process makes it)."""
    from kvexp.app.compose import drop_backend_only, to_experiment  # kvexp only when a job needs it

    exp = to_experiment(cfg)
    exp = drop_backend_only(exp, list(vars(exp.backend)))  # the keys of other backends of the sweep
    exp.output_dir = str(folder)
    return exp


def _finished(cfg: Any, folder: Path) -> bool:
    """Whether a resumed sweep's job is finished in its folder (complete or skipped, of the same spec):
    it is not submitted again, where it would wait in the queue for a GPU only to read its result."""
    from kvexp.app.preflight import is_finished
    from kvexp.results.documents import JobResult
    from kvexp.results.store import RESULT_FILE, ResultError, load_document

    try:
        _, doc = load_document(folder / RESULT_FILE)
    except (ResultError, OSError):
        return False
    return is_finished(JobResult.from_json(doc), _experiment(cfg, folder))


def _unrun(cfg: Any, folder: Path, why: str) -> str:
    """A job that left no result file at all (cancelled while it was pending: it never started) gets a
    failed result of its own, so that the sweep's exit status counts it, its report lists it and
    `resume` runs it; its label. A result file that cannot be read is left as it is (its folder's name)."""
    from kvexp.measure.runner import unrun_result
    from kvexp.results.store import RESULT_FILE

    if (folder / RESULT_FILE).exists():
        return folder.name
    return str(unrun_result(_experiment(cfg, folder), folder, why, status="failed").label)


if SlurmLauncher is not None:
    class KvexpSlurmLauncher(SlurmLauncher):  # type: ignore[misc, valid-type]
        """SlurmLauncher whose sweep goes on when one of its jobs does not finish (see the module)."""

        def __call__(self, *args: Any, **kwargs: Any) -> JobReturn:
            """A job, in its own process on the node: Hydra loads its config without the schema notice."""
            from kvexp.app.compose import hide_schema_notice  # the job's process has not composed anything

            hide_schema_notice()
            return super().__call__(*args, **kwargs)

        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
            """Submit the jobs as one array, as SlurmLauncher does, and wait for each of them."""
            import submitit  # lazy, as in SlurmLauncher: plugin discovery stays fast
            from hydra.core.singleton import Singleton
            from hydra.core.utils import filter_overrides
            from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
            from omegaconf import OmegaConf

            assert self.config is not None and len(job_overrides) > 0
            init = {"folder": self.params["submitit_folder"]}
            if "max_num_timeout" in self.params:
                init["slurm_max_num_timeout"] = self.params["max_num_timeout"]
            executor = submitit.AutoExecutor(cluster="slurm", **init)
            base = set(OmegaConf.structured(BaseQueueConf).keys())
            executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in self.params.items()
                                          if k not in ("submitit_folder", "max_num_timeout")})
            sweep_dir = Path(str(self.config.hydra.sweep.dir))
            sweep_dir.mkdir(parents=True, exist_ok=True)
            log.info("Submitit 'slurm' sweep output dir : %s", sweep_dir)
            numbered = [(num, list(o), self._job_config(list(o), num))
                        for num, o in enumerate(job_overrides, initial_job_idx)]
            kept = {num for num, _, cfg in numbered if cfg.get("resume") and _finished(cfg, self._folder(cfg))}
            params = []
            for num, overrides, _ in numbered:
                log.info("\t#%d : %s%s", num, " ".join(filter_overrides(overrides)),
                         "  (finished: kept, not submitted)" if num in kept else "")
                if num not in kept:
                    params.append((overrides, "hydra.sweep.dir", num, f"job_id_for_{num}", Singleton.get_state()))
            try:
                with _stderr_held():  # sbatch's own lines: shown after a submission, folded into one on a refusal
                    jobs = dict(zip((p[2] for p in params), executor.map_array(self, *zip(*params)))) if params else {}
            except submitit.core.utils.FailedJobError as e:  # sbatch refused the array: nothing was submitted
                _drop_unsubmitted(sweep_dir)
                raise SystemExit(f"kvexp: Slurm refused the sweep's jobs, none was submitted: {_refusal(str(e))}")
            return [JobReturn(overrides=o, status=JobStatus.COMPLETED, working_dir=str(self._folder(cfg)))
                    if num in kept else self._outcome(jobs[num], o, cfg) for num, o, cfg in numbered]

        def _outcome(self, job: Any, overrides: list[str], cfg: Any) -> JobReturn:
            """The job's JobReturn; one that did not finish is logged in one line and recorded in its
            result, and returned as done (with no value) so that Hydra goes on with the sweep."""
            try:
                ret = job.results()[0]
                # scancel's SIGTERM reaches the server too, and submitit's handler ignores it in the job's
                # own process: a cancelled job may still return in the grace before SIGKILL (its server
                # "exited"). Slurm's own state, asked afresh, says what became of it.
                if str(job.watcher.get_state(job.job_id, mode="force")).startswith(CUT_SHORT):
                    why = _why(job)
                elif ret.status != JobStatus.FAILED:
                    return ret
                else:
                    why = _failed(ret, job)
            except Exception:  # cancelled, timed out, node lost, or the job's process died: no JobReturn
                why = _why(job)
            folder = self._folder(cfg)
            label = _record(folder, why) or _unrun(cfg, folder, why)
            log.error("%s: %s", label, why)
            return JobReturn(overrides=overrides, status=JobStatus.COMPLETED, working_dir=str(folder))

        def _job_config(self, overrides: list[str], num: int) -> Any:
            """Job `num`'s config as Hydra composes it on the node."""
            assert self.config is not None and self.hydra_context is not None
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
            with open_dict(cfg.hydra.job):
                cfg.hydra.job.num = num
            return cfg

        def _folder(self, cfg: Any) -> Path:
            """The folder Hydra gives a job of this sweep (hydra.sweep.dir / hydra.sweep.subdir)."""
            assert self.config is not None
            return Path(str(self.config.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)

    # kvexp's settings of submitit_slurm (conf/), run by this launcher
    ConfigStore.instance().store(group="hydra/launcher", name="kvexp_slurm", provider="kvexp",
                                 node={"defaults": ["submitit_slurm", "_self_"], "_target_": TARGET})
