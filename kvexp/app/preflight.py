"""Before a run or sweep writes anything: which folder it writes into, whether that folder may be
written (writable, not another kvexp's, no results a fresh run would overwrite), and whether a resume
asks for the spec the folder was measured with. Everything here refuses with one line, and a refusal
leaves the folder exactly as it was: Hydra writes multirun.yaml and .hydra/ only after these checks.

The folder is held with an exclusive flock(2) on the folder itself (no lock file is created in it)
for as long as kvexp runs; the kernel drops it however kvexp ends. The holder of a lock is read from
/proc/locks. flock on a network file system may be local to one machine: a second machine's run is
not seen there."""

from __future__ import annotations

import fcntl
import os
import re
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException

from kvexp.core.config import ConfigError, ExperimentConfig, job_label
from kvexp.results.documents import JobResult
from kvexp.results.store import RESULT_FILE, ResultError, load_document, spec_hash
from kvexp.results.validate import request_log_problem

DIR_KEYS = ("hydra.sweep.dir", "hydra.run.dir")
NO_RUN_FLAGS = ("--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i", "--shell-completion", "-sc")
_HELD: dict[Path, int] = {}  # folders this process holds: path -> open descriptor


@dataclass(frozen=True)
class Target:
    folder: Path
    multirun: bool
    explicit: bool  # the command line named the folder (else kvexp pinned Hydra's default)


def quote_path(path: Path) -> str:
    """A path as an override value Hydra's grammar reads back unchanged."""
    where = str(path)
    if re.fullmatch(r"[\w./-]+", where):
        return where
    return "'" + where.replace("\\", "\\\\").replace("'", "\\'") + "'"


def dir_override(overrides: list[str], multirun: bool) -> Optional[str]:
    """The folder the command line gives, as Hydra reads it (quotes and escapes undone: the folder locked
    and checked here is the one Hydra writes into)."""
    key = DIR_KEYS[0] if multirun else DIR_KEYS[1]
    found = [o for o in overrides if o.split("=", 1)[0].lstrip("+") == key]
    if not found:
        return None
    try:
        return str(OverridesParser.create().parse_override(found[-1]).value())
    except OverrideParseException:  # Hydra's own parse of the same override says what is wrong
        return found[-1].split("=", 1)[1].strip("'\"")


def holder(path: Path) -> Optional[int]:
    """The pid holding an flock on path, from /proc/locks (None when unknown)."""
    try:
        st = os.stat(path)
        text = Path("/proc/locks").read_text()
    except OSError:
        return None
    ino = f":{st.st_ino} "
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[1] == "FLOCK" and f"{parts[5]} ".endswith(ino):
            try:
                return int(parts[4])
            except ValueError:
                return None
    return None


def lock(folder: Path) -> None:
    """Hold folder exclusively until this process ends; ConfigError naming the holder's pid when
    another kvexp holds it."""
    folder = folder.resolve()
    if folder in _HELD:
        return
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        pid = holder(folder)
        who = f"pid {pid}" if pid else "another process"
        raise ConfigError(f"{folder}: another kvexp ({who}) is writing into this folder; wait for it to end "
                          "or choose another folder") from None
    _HELD[folder] = fd


def unlock_all() -> None:
    for folder, fd in list(_HELD.items()):
        os.close(fd)
        del _HELD[folder]


PROBE_BYTES = 64 << 10


def ensure_writable(folder: Path) -> None:
    """Make the folder (and its parents) and prove PROBE_BYTES can be written there (Hydra's saved config
    and a first result: a disk already full fails here, not in Hydra's own writes), or one line saying why."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".kvexp-probe-")
        try:
            with os.fdopen(fd, "wb") as f:  # a short write goes on until the disk says it is full
                f.write(bytes(PROBE_BYTES))
        finally:
            os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{folder}: cannot write results here: {e.strerror or e}") from None


def existing_results(folder: Path, multirun: bool) -> list[tuple[Path, str, Optional[str]]]:
    """(result file, label, config hash) of each result already in a run or sweep folder (jobs of one
    sweep may share a label, e.g. a sweep over backend.threads: each is its own entry)."""
    paths = sorted(folder.glob(f"*/{RESULT_FILE}")) if multirun else [folder / RESULT_FILE]
    out = []
    for p in paths:
        if not p.is_file():
            continue
        try:
            job = JobResult.from_json(load_document(p)[1])
        except ResultError:
            out.append((p, p.parent.name, None))
            continue
        out.append((p, str(job.label or p.parent.name), job.config_hash))
    return out


def is_finished(job: JobResult, cfg: ExperimentConfig) -> bool:
    """Whether a job's result leaves a resume nothing to do: complete or skipped, of this spec, with no
    quality measurement still to make."""
    from kvexp.quality.measure import missing  # the quality stack is loaded only for a resume

    return (job.config_hash == spec_hash(cfg) and job.status in ("complete", "skipped")
            and not missing(cfg, job.quality))


def finished_jobs(folder: Path, multirun: bool, cfgs: list[ExperimentConfig]) -> Optional[str]:
    """How a run or sweep folder whose every job is finished reads ("its 4 jobs are finished (3
    complete, 1 skipped)"), or None when a resume has something left to do: a job without a result, a
    result of another spec, a partial or failed job, quality still to measure, a sweep without its
    summary (sweep.json)."""
    if multirun and not (folder / "sweep.json").is_file():
        return None
    paths = {(label, sha): path for path, label, sha in existing_results(folder, multirun)}
    counts: dict[str, int] = {}
    for cfg in cfgs:
        path = paths.get((job_label(cfg), spec_hash(cfg)))
        if path is None:
            return None
        try:
            job = JobResult.from_json(load_document(path)[1])
        except ResultError:
            return None
        if not is_finished(job, cfg):
            return None
        counts[str(job.status)] = counts.get(str(job.status), 0) + 1
    what = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    return (f"its {len(cfgs)} jobs are finished ({what})" if multirun else f"its job is finished ({what})")


def saved_task_overrides(folder: Path, multirun: bool) -> Optional[list[str]]:
    """The task overrides Hydra saved for the folder's run or sweep (None when there are none)."""
    from omegaconf import OmegaConf

    saved = folder / ("multirun.yaml" if multirun else ".hydra/hydra.yaml")
    if not saved.is_file():
        return None
    try:
        task = OmegaConf.to_container(OmegaConf.load(saved).hydra.overrides.task, resolve=False)
    except Exception:  # noqa: BLE001 (an unreadable file: resume_args reports it)
        return None
    return sorted(_spec_args(task)) if isinstance(task, list) else None


def _spec_args(args: list[Any]) -> list[str]:
    return [str(a) for a in args if str(a).split("=", 1)[0].lstrip("+~") not in ("resume", "hydra.mode", *DIR_KEYS)]


def check_resume(folder: Path, multirun: bool, overrides: list[str],
                 jobs: list[tuple[list[str], ExperimentConfig]], argv: list[str]) -> None:
    """A resume must ask for exactly the spec the folder was measured with: the same task overrides
    and, job by job, the same config hash. Otherwise nothing is measured or written, and the message
    says how to measure the new spec in a new folder."""
    task = [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/"))]  # Hydra's own: not the spec
    saved = saved_task_overrides(folder, multirun)
    results = existing_results(folder, multirun)
    new: dict[str, set[str]] = {}
    for _, cfg in jobs:
        new.setdefault(job_label(cfg), set()).add(spec_hash(cfg))
    why = None
    if saved is not None and saved != sorted(_spec_args(task)):
        why = f"its overrides were {' '.join(saved) or '(none)'}, now {' '.join(sorted(_spec_args(task))) or '(none)'}"
    for _, label, old in results:
        if why:
            break
        if label in new and old is not None and old not in new[label]:
            why = f"job {label}: config hash {old}, now {' or '.join(sorted(new[label]))}"
    fresh = [a for a in argv if a.split("=", 1)[0].lstrip("+~") not in ("resume", *DIR_KEYS)]
    again = f"start a new {'sweep' if multirun else 'run'}: python -m kvexp {' '.join(shlex.quote(a) for a in fresh)}"
    if why is not None:
        raise ConfigError(f"{folder}: the spec changed since it was measured ({why}); nothing in the folder was "
                          f"changed. To measure the new spec, {again}")
    for path, _, _ in results:  # a resume keeps finished levels with their requests: they must be there
        try:
            problem = request_log_problem(path.parent, load_document(path)[1])
        except ResultError:
            continue  # the job's own resume says what is wrong with its result
        if problem:
            raise ConfigError(f"resume refused: {problem}; nothing in the folder was changed. To measure it "
                              f"again, {again}")


def check_job(cfg: ExperimentConfig) -> None:
    """What a job would refuse once it runs, refused before any folder is made: the server program and
    model, the adapter's own rules (Ollama's KV types and variables), the API key, and the quality inputs
    (the evaluation text, the depths against the model's context, an attached server)."""
    from kvexp import backends
    from kvexp.backends.base import auth_headers
    from kvexp.measure.gpu import gpu_info
    from kvexp.planning import prediction
    from kvexp.quality.inputs import check_inputs
    from kvexp.quality.measure import wanted

    backend = backends.create(cfg)
    auth_headers(cfg)
    g = cfg.gpu
    if (g.name or g.memory_gib) and not cfg.backend.endpoint and gpu_info(g.index, quiet=True).name is None:
        given = f"gpu.name={g.name}" if g.name else f"gpu.memory_gib={g.memory_gib:g}"
        raise ConfigError(f"{given}: kvexp sees no GPU here (NVML), so the server it launches runs on the CPU, and "
                          "its results would be labelled with that GPU; leave gpu unset, or plan for that GPU with "
                          "python -m kvexp plan gpu=...")
    if wanted(cfg):
        try:
            arch = prediction.model_arch(cfg, backend.spec)
        except (ValueError, OSError):  # unreadable model files: the job says so, and checks what it can
            arch = None
        check_inputs(cfg, arch)


def check_model_file(cfg: ExperimentConfig) -> None:
    """A model file that does not exist is refused now, not once the job's folder exists (the adapter
    checks it again when it resolves the model); so are a preset that the file contradicts and a download
    model.allow_download=false forbids."""
    from kvexp.backends import adapter_class

    if not cfg.backend.endpoint:
        adapter_class(cfg.backend.name).check_model(cfg)
        check_preset(cfg)
        if cfg.model.allow_download is False and (hub := _hub_download(cfg)):
            raise ConfigError(f"model.hf={hub}: not in the local Hugging Face cache ({_hub_cache()}), and "
                              "model.allow_download=false refuses vLLM's download of it; download it first "
                              f"(huggingface-cli download {hub}) or allow it")


def _hub_download(cfg: ExperimentConfig) -> Optional[str]:
    from kvexp.backends import adapter_class
    from kvexp.capacity import modelinfo

    return modelinfo.hub_download(cfg.model, adapter_class(cfg.backend.name).served_field(cfg.model))


def _hub_cache() -> str:
    return os.environ.get("HF_HUB_CACHE") or os.path.join(os.environ.get("HF_HOME") or "~/.cache/huggingface", "hub")


def check_preset(cfg: ExperimentConfig) -> None:
    """A model whose architecture numbers (its preset's, or given as model.*) contradict the file it serves
    is another model: refused in one line, since the file's numbers are the ones planned (modelinfo.arch_from)."""
    from kvexp.backends import adapter_class
    from kvexp.capacity import modelinfo

    field = adapter_class(cfg.backend.name).served_field(cfg.model)
    try:
        conflicts, files = modelinfo.preset_conflicts(cfg.model, field)
    except (OSError, ValueError):  # an unreadable file: the adapter's own check names it
        return
    if conflicts:
        key, given, read, how = conflicts[0]
        more = f" (and {', '.join(c[0] for c in conflicts[1:])})" if len(conflicts) > 1 else ""
        raise ConfigError(f"model={cfg.model.name} gives {key}={given:g}{more}, but {files} says {read:g} ({how}): "
                          f"that file is another model; give model.{field}=PATH alone (its architecture is read "
                          "from the file) or the preset of that model")


def download_notes(jobs: list[tuple[list[str], ExperimentConfig]]) -> list[str]:
    """A line for each hub id a job's server will download when it starts, said before the first job."""
    notes: dict[str, str] = {}
    for _, cfg in jobs:
        hub = None if cfg.backend.endpoint or not cfg.model.allow_download else _hub_download(cfg)
        if hub and hub not in notes:
            size = f", about {cfg.model.weights_gib:.1f} GiB of weights (model.weights_gib)" if cfg.model.weights_gib else ""
            notes[hub] = (f"model.hf={hub} is not in the local Hugging Face cache ({_hub_cache()}): the server downloads "
                          f"it when it starts{size}; a gated repository needs HF_TOKEN; model.allow_download=false "
                          "refuses the download")
    return list(notes.values())


def prepare(argv: list[str], overrides: list[str], jobs: list[tuple[list[str], ExperimentConfig]],
            default_folder: Path) -> tuple[list[str], Optional[Path]]:
    """Check and hold the run's or sweep's folder; returns the overrides to hand Hydra (with the folder
    pinned, so that the folder held is the folder Hydra writes) and that folder (None: Hydra only
    prints, nothing is run)."""
    for _, cfg in jobs:
        check_model_file(cfg)
    if any(a.split("=", 1)[0] in NO_RUN_FLAGS for a in argv):
        return list(argv), None  # Hydra only prints (help, the config): no folder is made or held
    multirun = "-m" in argv or "--multirun" in argv
    given = dir_override(overrides, multirun)
    folder = Path(given).expanduser() if given else default_folder
    folder = folder if folder.is_absolute() else Path.cwd() / folder
    resume = any(cfg.resume for _, cfg in jobs)
    if folder.is_dir():
        lock(folder)  # first: while another kvexp writes here, nothing else about the folder is settled
        if resume:
            check_resume(folder, multirun, overrides, jobs, argv)
    ensure_writable(folder)
    lock(folder)
    if not resume:
        found = existing_results(folder, multirun)
        if found:
            raise ConfigError(f"{folder}: already holds {len(found)} result(s) ({found[0][0]}); "
                              "add resume=true to finish that run, or choose another folder")
    if given:
        return list(argv), folder
    key = DIR_KEYS[0] if multirun else DIR_KEYS[1]
    return [*argv, f"{key}={quote_path(folder)}"], folder
