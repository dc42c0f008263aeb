"""Versioned result files: written atomically after validation, read back with a version check, and
gathered from any mix of sweep folders, job folders and files into one aggregate."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

from kvexp import __version__
from kvexp.validate import ValidationFailed, errors_of, kind_of, validate_document

SCHEMA_VERSION = 1
RESULT_FILE = "result.json"
REQUESTS_FILE = "requests.jsonl"


class ResultError(ValueError):
    """A result file kvexp cannot use; the message is one line naming the file and the field."""


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def config_hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def environment(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Best-effort facts about where a run happened."""
    import aiohttp

    env: dict[str, Any] = {
        "kvexp_version": __version__,
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "aiohttp": aiohttp.__version__,
        "argv": sys.argv[1:],
    }
    return {**env, **(extra or {})}


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def write_json(path: Path, doc: dict[str, Any], kind: str) -> None:
    """Validate, then write atomically (temporary file + rename)."""
    validate_document(doc, kind, where=str(path))
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]], kind: str = "request") -> None:
    """Append rows (validated) to a JSONL file; each flush ends with a whole line."""
    lines = []
    for row in rows:
        validate_document(row, kind, where=str(path))
        lines.append(json.dumps(row, allow_nan=False))
    if lines:
        with open(path, "a") as f:
            f.write("\n".join(lines) + "\n")


def load_json(path: Path) -> Any:
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ResultError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ResultError(f"{path}: is a folder, not a result file") from None
    except OSError as e:
        raise ResultError(f"{path}: cannot read: {e.strerror}") from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise ResultError(f"{path}: not JSON ({e})") from None


def load_document(path: Path) -> tuple[str, dict[str, Any]]:
    """A result or aggregate file, checked: (kind, document)."""
    doc = load_json(path)
    if not isinstance(doc, dict):
        raise ResultError(f"{path}: $: expected a JSON object, found {type(doc).__name__}")
    version = doc.get("schema_version")
    if isinstance(version, int) and version > SCHEMA_VERSION:
        raise ResultError(f"{path}: $.schema_version: {version} is newer than this kvexp understands "
                          f"({SCHEMA_VERSION}); upgrade kvexp")
    kind = kind_of(doc)
    errs = errors_of(doc, kind)
    if errs:
        raise ResultError(str(ValidationFailed(str(path), errs)))
    return kind, doc


def find_results(paths: Iterable[Path]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            found = sorted(p.rglob(RESULT_FILE))
            if not found:
                raise ResultError(f"{p}: no {RESULT_FILE} found in this folder")
            out += found
        elif p.exists():
            out.append(p)
        else:
            raise ResultError(f"{p}: no such file or folder")
    return out


def run_of(result: dict[str, Any], source: str | None = None) -> dict[str, Any]:
    """A job result as one run of the aggregate shape."""
    kv_cache = {"dtype": None, "blocks": None, "block_size": None, "gpu_memory_utilization": None,
                **result["kv_cache"]}
    started = result.get("started_at") or ""
    return {
        "label": result["label"],
        "backend": result["backend"]["name"],
        "model": result["model"].get("path") or result["model"]["name"],
        "scenario": result["scenario"]["name"],
        "prompt_tokens": result["scenario"]["prompt_tokens"],
        "max_tokens": result["scenario"]["max_tokens"],
        "started_at": started.replace("T", " ")[:16] + " UTC" if started else None,
        "gpu": result["gpu"].get("name"),
        "gpu_gib": result["gpu"].get("memory_gib"),
        "kv_cache": kv_cache,
        "levels": result["levels"],
        "status": result["status"],
        "status_reason": result.get("status_reason"),
        "backend_version": result["backend"].get("version"),
        "launch_command": result["backend"].get("launch_command"),
        "variable_length": result["scenario"]["variable_length"],
        "kv_requested": result["kv"]["requested"],
        "reused_server": result["backend"]["reused_server"],
        "planner": result.get("planner"),
        "source": source,
    }


def collect(paths: Iterable[Path]) -> dict[str, Any]:
    """One aggregate from any mix of sweep folders, job folders, result files and aggregates."""
    runs: list[dict[str, Any]] = []
    calibration: list[dict[str, Any]] = []
    planner = None
    results: list[dict[str, Any]] = []
    gpu, gpu_gib, environment_ = None, None, None
    for path in find_results(paths):
        kind, doc = load_document(path)
        if kind == "aggregate":
            runs += doc["runs"]
            calibration += doc.get("calibration") or []
            planner = planner or doc.get("planner")
            gpu, gpu_gib = gpu or doc.get("gpu"), gpu_gib or doc.get("gpu_gib")
        else:
            results.append(doc)
            runs.append(run_of(doc, str(path)))
            environment_ = environment_ or doc.get("environment")
            gpu = gpu or doc["gpu"].get("name")
            gpu_gib = gpu_gib or doc["gpu"].get("memory_gib")
    if results:
        calibration += _calibration_rows(results)
    agg = {
        "schema_version": SCHEMA_VERSION,
        "kind": "kvexp.aggregate",
        "kvexp_version": __version__,
        "environment": environment_,
        "gpu": gpu,
        "gpu_gib": gpu_gib,
        "run_dates": sorted({r["started_at"] for r in runs if r.get("started_at")}),
        "runs": runs,
        "calibration": calibration,
        "planner": planner,
    }
    validate_document(agg, "aggregate", where="aggregate")
    return agg


def _calibration_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    try:
        from kvexp.calibration import calibration_rows
    except ImportError:
        return []
    return calibration_rows(results)
