"""`hydra/launcher=kvexp_slurm`: hydra-submitit-launcher's Slurm launcher, with kvexp's settings of
`submitit_slurm` (conf/hydra/launcher/submitit_slurm.yaml), that waits for every job of a sweep and
turns a job that did not finish (cancelled with scancel, past its time limit, its node lost, or failed)
into one line naming it, recorded in that job's result.json (status failed, with Slurm's state), instead
of an exception that ends the sweep: the other jobs' results stay, the sweep's report is written, kvexp
exits 1 (a job says failed), and `python -m kvexp resume` runs again only what is missing."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import open_dict

try:
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
except ImportError:  # hydra-submitit-launcher (kvexp's `cluster` extra) is not installed: nothing to extend
    SlurmLauncher = None

log = logging.getLogger("kvexp")
TARGET = "hydra_plugins.kvexp_launcher.slurm.KvexpSlurmLauncher"


def _why(job: Any) -> str:
    """One line: what Slurm says became of a job that left no result, and where its output is."""
    state = str(getattr(job, "state", "") or "UNKNOWN")
    what = "cancelled" if state.startswith("CANCELLED") else "ended before it finished"
    return f"{what} (Slurm job {job.job_id}: {state}; its output: {job.paths.stderr})"


def _failed(ret: JobReturn, job: Any) -> str:
    first = (str(ret._return_value).splitlines() or [type(ret._return_value).__name__])[0]
    return f"failed: {first} (Slurm job {job.job_id}; its output: {job.paths.stderr})"


def _record(folder: Path, why: str) -> str | None:
    """Say in the job's result.json why it ended, unless it says complete or skipped; the job's label
    (None when the job left no readable result)."""
    from kvexp.results.store import RESULT_FILE, ResultError, load_document, write_json  # kvexp only on a failure

    try:
        _, doc = load_document(folder / RESULT_FILE)
        if doc["status"] not in ("complete", "skipped"):
            doc.update(status="failed", status_reason=why)
            write_json(folder / RESULT_FILE, doc, "result")
        return str(doc["label"])
    except (ResultError, OSError):
        return None


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
            params = []
            for num, overrides in enumerate(job_overrides, initial_job_idx):
                log.info("\t#%d : %s", num, " ".join(filter_overrides(overrides)))
                params.append((list(overrides), "hydra.sweep.dir", num, f"job_id_for_{num}", Singleton.get_state()))
            jobs = executor.map_array(self, *zip(*params))
            return [self._outcome(job, list(o), num) for num, (o, job) in enumerate(zip(job_overrides, jobs),
                                                                                   initial_job_idx)]

        def _outcome(self, job: Any, overrides: list[str], num: int) -> JobReturn:
            """The job's JobReturn; one that did not finish is logged in one line and recorded in its
            result, and returned as done (with no value) so that Hydra goes on with the sweep."""
            try:
                ret = job.results()[0]
                if ret.status != JobStatus.FAILED:
                    return ret
                why = _failed(ret, job)
            except Exception:  # cancelled, timed out, node lost, or the job's process died: no JobReturn
                why = _why(job)
            folder = self._job_dir(overrides, num)
            label = _record(folder, why) or folder.name
            log.error("%s: %s", label, why)
            return JobReturn(overrides=overrides, status=JobStatus.COMPLETED, working_dir=str(folder))

        def _job_dir(self, overrides: list[str], num: int) -> Path:
            """The folder Hydra gives job `num` of this sweep (hydra.sweep.dir / hydra.sweep.subdir)."""
            assert self.config is not None and self.hydra_context is not None
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
            with open_dict(cfg.hydra.job):
                cfg.hydra.job.num = num
            return Path(str(self.config.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)

    # kvexp's settings of submitit_slurm (conf/), run by this launcher
    ConfigStore.instance().store(group="hydra/launcher", name="kvexp_slurm", provider="kvexp",
                                 node={"defaults": ["submitit_slurm", "_self_"], "_target_": TARGET})
