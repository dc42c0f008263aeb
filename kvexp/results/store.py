"""Versioned result files: written atomically after validation, read back with a version check, and
found in any mix of sweep folders, job folders and files (kvexp.analysis.aggregate gathers them into one
aggregate). A job folder's result can also be taken up again (resume): its finished levels and their
requests are kept."""

from __future__ import annotations

import json
import multiprocessing
import os
import platform
import socket
import sys
import threading
from concurrent.futures import BrokenExecutor, ProcessPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import aiohttp

from kvexp.core import __version__, machine
from kvexp.core.config import to_plain
from kvexp.core.paths import atomic_write
from kvexp.metrics.levels import Level
from kvexp.results import foreign, guards
from kvexp.results.documents import JobResult
from kvexp.results.validate import (SCHEMA_VERSION, FileRefused, ValidationFailed, config_hash,  # noqa: F401
                                    inspect_file,
                                    json_lines_of, kind_of, parse_json, read_bounded, read_errors, validate_document)

RESULT_FILE = "result.json"
REQUESTS_FILE = "requests.jsonl"


class ResultError(ValueError):
    """A result file kvexp cannot use; the message is one line naming the file and the field."""


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def spec_of(cfg: Any) -> dict[str, Any]:
    """A job's resolved config as results record it: what it measures, without where it writes, whether
    it resumed, how much of a server's log it keeps (backend.server_log_bytes records that) or the name of
    the variable holding an API key (none of these differ between runs of one spec)."""
    plain = to_plain(cfg)
    plain.pop("output_dir", None)
    plain.pop("resume", None)
    plain.pop("log", None)
    plain["backend"].pop("api_key_env", None)
    return plain


def spec_hash(cfg: Any) -> str:
    return config_hash(spec_of(cfg))


def environment(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Best-effort facts about where a run happened."""
    env: dict[str, Any] = {
        "kvexp_version": __version__,
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": machine.cpu_model(),
        "cpu_count": os.cpu_count(),
        "aiohttp": aiohttp.__version__,
        "argv": sys.argv[1:],
        "scheduler": scheduler(),
    }
    return {**env, **(extra or {})}


def scheduler() -> dict[str, Any] | None:
    """The batch job this run is, from the scheduler's environment: Slurm's job id, and for a job array (as
    submitit submits a sweep) the array's job id and this job's task, so `squeue`/`sacct -j` find it
    (`<array_job_id>_<array_task_id>`), and the node it ran on; None outside a scheduler."""
    job_id = os.environ.get("SLURM_JOB_ID") or os.environ.get("SLURM_JOBID")
    if not job_id:
        return None
    task = os.environ.get("SLURM_ARRAY_TASK_ID", "")
    return {"kind": "slurm", "job_id": job_id, "array_job_id": os.environ.get("SLURM_ARRAY_JOB_ID") or None,
            "array_task_id": int(task) if task.isdigit() else None,
            "node": os.environ.get("SLURMD_NODENAME") or None}


def write_json(path: Path, doc: dict[str, Any], kind: str) -> None:
    """Validate, then write atomically (temporary file + rename)."""
    validate_document(doc, kind, where=str(path))
    atomic_write(path, json.dumps(doc, indent=1, allow_nan=False) + "\n")


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]], kind: str = "request") -> None:
    """Append rows (validated) to a JSONL file, all or none: when the write fails (a full disk, a quota)
    the file is cut back to its length before, so it never ends in a cut line and the space the failed
    write took is free again for the result file that records why."""
    lines = []
    for row in rows:
        validate_document(row, kind, where=str(path))
        lines.append(json.dumps(row, allow_nan=False))
    if not lines:
        return
    data = ("\n".join(lines) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        before = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError as e:
            os.ftruncate(fd, before)
            raise OSError(e.errno, e.strerror, str(path)) from None
    finally:
        os.close(fd)


def load_json(path: Path) -> Any:
    try:
        text = read_bounded(Path(path)).decode("utf-8")
    except FileRefused as e:
        raise ResultError(str(e)) from None
    except FileNotFoundError:
        raise ResultError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ResultError(f"{path}: is a folder, not a result file") from None
    except OSError as e:
        raise ResultError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ResultError(f"{path}: not JSON (not UTF-8 text)") from None
    try:
        return parse_json(text)
    except ValueError as e:
        raise ResultError(f"{path}: not JSON ({e})") from None


def json_lines(path: Path) -> list[Any] | None:
    """A file of one JSON object per line (what `vllm bench serve --append-result` writes), or None when
    the file is not that (or cannot be read: the same guards as every other read)."""
    try:
        docs = json_lines_of(read_bounded(Path(path)).decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return docs if docs is not None and all(isinstance(d, dict) for d in docs) else None


def _refuse(errors: list[str]) -> ResultError:
    """A file's problems as one line: the first, and how many more (`kvexp validate FILE` lists them)."""
    return ResultError(errors[0] + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""))


def load_any(path: Path) -> tuple[str, Any]:
    """Any file kvexp reads: ("result" | "aggregate", the checked document), or ("foreign", the parsed
    JSON) for another tool's result recognised by its shape (kvexp.results.foreign), its fields checked.
    The reading and the checks are validate's (kvexp.results.validate.inspect_file): a file of no known
    shape, or one validate refuses, is refused with one line naming the file and what is wrong."""
    found = inspect_file(Path(path), not_json=" ({})", whole_mapping=False, jsonl=False)
    if found.errors:
        raise _refuse(found.errors)
    return found.kind, found.doc


PARALLEL_MIN_FILES = 64  # below this many, one process reads them sooner than a pool starts
MAX_READERS = 4


def load_all(paths: list[Path]) -> Iterator[tuple[Path, str, Any]]:
    """(path, kind, document) of each file, in order, as load_any reads and checks it (its ResultError
    raised when its turn comes). Many files are read by worker processes, one per CPU (parsing and
    checking a thousand results is seconds of one core); a few, one CPU, or a process that holds other
    threads (fork is then unsafe, and a worker that imports kvexp afresh costs more than it saves) reads
    them itself."""
    workers = min(machine.usable_cpus(), MAX_READERS)
    done = 0
    if workers > 1 and len(paths) >= PARALLEL_MIN_FILES and threading.active_count() == 1 \
            and "fork" in multiprocessing.get_all_start_methods():
        try:
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
                for path, found in zip(paths, pool.map(load_any, paths, chunksize=16)):
                    yield (path, *found)
                    done += 1
            return
        except BrokenExecutor:  # (a worker died: the rest are read here)
            pass
    for path in paths[done:]:
        yield (path, *load_any(path))


def load_document(path: Path, doc: Any = None) -> tuple[str, dict[str, Any]]:
    """A result or aggregate file, checked as every command checks it: (kind, document). `doc`: the
    file already parsed (then only its schema and sanity rules are checked)."""
    if doc is None:
        kind, doc = load_any(path)
        if kind == "foreign":
            raise ResultError(f"{path}: a result file of another tool, not a kvexp result or aggregate")
        return kind, doc
    if not isinstance(doc, dict):
        raise ResultError(f"{path}: $: expected a JSON object, found {type(doc).__name__}")
    version = doc.get("schema_version")
    if isinstance(version, int) and version > SCHEMA_VERSION:
        raise ResultError(f"{path}: $.schema_version: {version} is newer than this kvexp understands "
                          f"({SCHEMA_VERSION}); upgrade kvexp")
    kind = kind_of(doc)
    errs = read_errors(doc, kind)
    if errs:
        raise ResultError(str(ValidationFailed(str(path), errs)))
    return kind, doc


def previous_result(path: Path, config_hash: str) -> Optional[JobResult]:
    """The result already in a job folder, to resume it: None when there is none. Raises ResultError
    when it cannot be read or comes from a different spec (its levels must not be mixed with new ones)."""
    if not path.exists():
        return None
    kind, doc = load_document(path)
    if kind != "result":
        raise ResultError(f"{path}: not a job result, cannot resume from it")
    if doc["config_hash"] != config_hash:
        raise ResultError(f"{path.parent}: the spec changed since this job ran (config hash {doc['config_hash']}, "
                          f"now {config_hash}); resume refuses to mix results: use a new folder or remove this one")
    return JobResult.from_json(doc)


def finished_levels(levels: list[Level], repeats: int) -> dict[float, list[Level]]:
    """The repeats that ended ok, by level value: for each value its entries for repeats 0, 1, ... up to
    the first that is missing or did not end ok (a resume measures that one and those after it again;
    a level's last repeat sums up the ones before it)."""
    ok: dict[float, dict[int, Level]] = {}
    for lv in levels:
        if lv.status == "ok" and lv.x is not None:
            ok.setdefault(lv.x[1], {}).setdefault(lv.repeat or 0, lv)
    kept: dict[float, list[Level]] = {}
    for v, by_rep in ok.items():
        for r in range(repeats):
            if r not in by_rep:
                break
            kept.setdefault(v, []).append(by_rep[r])
    return kept


def keep_requests(path: Path, keep: set[tuple[float, int]]) -> None:
    """Rewrite a requests.jsonl with only the measured requests of the (level, repeat) pairs kept;
    warm-up lines, other levels' lines, a line cut short by a crash and a line longer than a request's
    (guards.MAX_LINE_BYTES) go. Read as every requests.jsonl is: a regular file only (ResultError for a
    FIFO or device), at most guards.MAX_JSONL_BYTES, line by line."""
    kept = []
    if path.exists():
        try:
            for _, raw in guards.regular_lines(path, guards.MAX_JSONL_BYTES, guards.MAX_LINE_BYTES):
                line = raw.decode("utf-8", "replace").rstrip("\n")
                try:
                    row = parse_json(line) if len(raw) <= guards.MAX_LINE_BYTES else None
                    key = (float(row["level"]), int(row["repeat"]))
                except (ValueError, KeyError, TypeError):
                    continue
                if not row.get("warmup") and key in keep:
                    kept.append(line + "\n")
        except FileRefused as e:
            raise ResultError(str(e)) from None
        except OSError as e:
            raise ResultError(f"{path}: cannot read: {e.strerror}") from None
    atomic_write(path, "".join(kept))


def find_results(paths: Iterable[Path]) -> list[Path]:
    """Result files named on the command line, and those in folders: every result.json, and every other
    JSON file outside kvexp's job folders that another tool wrote (recognised by its shape)."""
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            found = result_files(p)
            found += foreign_files(p, {f.parent for f in found})
            if not found:
                raise ResultError(f"{p}: no {RESULT_FILE} found in this folder")
            out += found
        elif p.exists() or p.is_symlink():  # (a link to nowhere, or a loop of links: its read says which)
            out.append(p)
        else:
            raise ResultError(f"{p}: no such file or folder")
    return once(out, set())


def result_files(folder: Path) -> list[Path]:
    """Every result.json under a folder, a link to nowhere or a loop of links included (its read says
    which): the plain name globs only entries that resolve, a pattern lists each by its name."""
    return sorted(folder.rglob(RESULT_FILE[:-1] + f"[{RESULT_FILE[-1]}]"))


def once(paths: Iterable[Path], seen: set[str]) -> list[Path]:
    """Each file once, however it was named (itself and through its folder, or a link): those of paths whose
    real path is not in seen yet, which they are added to (a loop of links is kept, for its read to name)."""
    out = []
    for f in paths:
        real = os.path.realpath(f)
        if real not in seen:
            seen.add(real)
            out.append(f)
    return out


def foreign_files(folder: Path, job_dirs: set[Path]) -> list[Path]:
    """Other tools' result files in a folder tree, outside kvexp's job folders and their reports. Read
    with the same guards as every file (a FIFO, a device or a huge file named *.json is not read); one
    of a known tool's shape is listed even when its fields are wrong (reading it then says what is)."""
    out = []
    for f in sorted(folder.rglob("*.json")):
        if f.name in (RESULT_FILE, "sweep.json", "comparison.json") or any(d in f.parents for d in job_dirs):
            continue
        try:
            doc = load_json(f)
        except ResultError:
            doc = json_lines(f)
        if foreign.sniff(doc) is not None:
            out.append(f)
    return out
