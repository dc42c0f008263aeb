"""JSON Schema validation of every file kvexp writes or reads (schema/*.schema.json, draft 2020-12)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

from kvexp.paths import data_dir

KINDS = ("result", "aggregate", "request")
SCHEMA_VERSION = 2  # the newest result format this kvexp reads and writes (2: typed warnings, server spec)


class ValidationFailed(ValueError):
    def __init__(self, where: str, errors: list[str]):
        self.errors = errors
        super().__init__(f"{where}: {errors[0]}" + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""))


@lru_cache(maxsize=None)
def validator(kind: str) -> Draft202012Validator:
    schema = json.loads((data_dir("schema") / f"{kind}.schema.json").read_text())
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def json_path(error: Any) -> str:
    out = "$"
    for p in error.absolute_path:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def errors_of(doc: Any, kind: str) -> list[str]:
    """Every violation as 'JSON-path: message', in document order."""
    errs = sorted(validator(kind).iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{json_path(e)}: {e.message}" for e in errs]


def kind_of(doc: Any) -> str:
    if isinstance(doc, dict):
        if doc.get("kind") == "kvexp.job" or ("levels" in doc and "runs" not in doc):
            return "result"
        if "runs" in doc:
            return "aggregate"
        if "token_times_s" in doc:
            return "request"
    return "result"


def validate_document(doc: Any, kind: str | None = None, where: str = "document") -> None:
    errs = errors_of(doc, kind or kind_of(doc))
    if errs:
        raise ValidationFailed(where, errs)


def check_file(path: Path) -> list[str]:
    """Violations of one file (JSON or JSONL), each 'FILE: JSON-path: message'."""
    try:
        text = path.read_text()
    except OSError as e:
        return [f"{path}: cannot read: {e.strerror}"]
    except UnicodeDecodeError:
        return [f"{path}: not JSON (not UTF-8 text)"]
    if path.suffix == ".jsonl":
        out = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except ValueError as e:
                out.append(f"{path}:{n}: not JSON: {e}")
                continue
            out += [f"{path}:{n}: {m}" for m in errors_of(doc, "request")]
        return out
    from kvexp import foreign

    try:
        doc = json.loads(text)
    except ValueError as e:
        doc = _json_lines(text)
        if foreign.sniff(doc) is None:
            return [f"{path}: not JSON: {e}"]
    if foreign.sniff(doc) is not None:
        return [f"{path}: {m}" for m in foreign_errors(doc, str(path))]
    if not foreign.looks_like_kvexp(doc):
        return [f"{path}: unknown shape: {foreign.EXPECTED}"]
    kind = kind_of(doc)
    version = doc.get("schema_version") if isinstance(doc, dict) else None
    if isinstance(version, int) and version > SCHEMA_VERSION:
        return [f"{path}: $.schema_version: {version} is newer than this kvexp understands "
                f"({SCHEMA_VERSION}); upgrade kvexp"]
    return [f"{path}: {m}" for m in errors_of(doc, kind)]


def _json_lines(text: str) -> Any:
    """One JSON object per line (`vllm bench serve --append-result`), else None."""
    try:
        docs = [json.loads(ln) for ln in text.splitlines() if ln.strip()]
    except ValueError:
        return None
    return docs if len(docs) > 1 else None


def foreign_errors(doc: Any, source: str) -> list[str]:
    """Why another tool's file cannot be mapped to kvexp's levels, or its mapping breaks the aggregate
    schema; [] when it maps cleanly."""
    from kvexp import foreign

    try:
        runs = foreign.runs_of(foreign.levels_of(doc, source))
    except foreign.ForeignFormatError as e:
        return [str(e)]
    return errors_of({"gpu": None, "gpu_gib": None, "runs": runs}, "aggregate")
