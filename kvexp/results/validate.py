"""JSON Schema validation of every file kvexp writes or reads (schema/*.schema.json, draft 2020-12),
plus what a schema cannot say: every number finite, counts that agree (errors <= requests, a complete
job has levels), sizes in the planner not negative; and, for a file read (inspect_file: one reading path
for validate, results, report and resume), the guards of kvexp.results.guards (regular files only, size,
nesting depth, percentiles in order, each level once, physical bounds, text lengths) and strict types for
other tools' fields (kvexp.results.foreign_fields), so that a hostile or corrupt file is refused with
its JSON path instead of read for ever or crashing."""

from __future__ import annotations

import hashlib
import json
import sys
import math
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

from kvexp.core.paths import data_dir
from kvexp.metrics.levels import level_x
from kvexp.results import foreign, guards
from kvexp.results.foreign_fields import field_errors
from kvexp.results.schemacheck import compile_schema

KINDS = ("result", "aggregate", "request")
SCHEMA_VERSION = 2  # the newest result format this kvexp reads and writes (2: typed warnings, server spec)
MAX_FILE_BYTES = guards.MAX_JSON_BYTES  # a result, aggregate or other tool's file (read at call time)
MAX_LINE_BYTES = guards.MAX_LINE_BYTES  # one line of requests.jsonl
MAX_DEPTH = guards.MAX_DEPTH  # nesting of objects and arrays (kvexp's own files nest 6 deep)
FileRefused = guards.FileRefused  # a file too large, not a regular file, or nested too deep


class TooDeep(ValueError):
    """JSON text nested too deeply to decode; refused in the same words by every command."""


class ValidationFailed(ValueError):
    def __init__(self, where: str, errors: list[str]):
        self.errors = errors
        super().__init__(f"{where}: {errors[0]}" + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""))


@lru_cache(maxsize=None)
def schema_of(kind: str) -> dict[str, Any]:
    return json.loads((data_dir("schema") / f"{kind}.schema.json").read_text())


@lru_cache(maxsize=None)
def validator(kind: str) -> Draft202012Validator:
    schema = schema_of(kind)
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


@lru_cache(maxsize=None)
def accepts(kind: str) -> Any:
    """The schema's fast yes/no check (kvexp.results.schemacheck): True only where jsonschema finds nothing."""
    return compile_schema(schema_of(kind))


def json_path(error: Any) -> str:
    out = "$"
    for p in error.absolute_path:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def _path(parts: tuple) -> str:
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts)


def structure_errors(doc: Any) -> list[str]:
    """Nesting deeper than MAX_DEPTH (reported once, at its first path) and every number that is not
    finite (NaN, Infinity, or a literal like 1e400 that overflows to infinity). Iterative: a deep
    document cannot exhaust the stack."""
    if _plain(doc):
        return []
    out: list[str] = []
    stack: list[tuple[tuple, Any]] = [((), doc)]
    while stack:
        parts, v = stack.pop()
        if isinstance(v, (dict, list)):
            if len(parts) >= MAX_DEPTH:
                return [f"{_path(parts)}: nested deeper than {MAX_DEPTH} levels; not a kvexp file"]
            items = v.items() if isinstance(v, dict) else enumerate(v)
            stack.extend(reversed([((*parts, k), x) for k, x in items]))
        elif isinstance(v, float) and not math.isfinite(v):
            out.append(f"{_path(parts)}: {v} is not a finite number (NaN, Infinity or out of range)")
    return out


def _plain(doc: Any) -> bool:
    """Whether doc nests at most MAX_DEPTH deep and holds only finite numbers: the common case, checked
    without building the path of every value (structure_errors builds them only when this says no)."""
    stack: list[tuple[int, Any]] = [(0, doc)]
    while stack:
        depth, v = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            if isinstance(v, float) and not math.isfinite(v):
                return False
            continue
        if depth >= MAX_DEPTH:
            return False
        for x in v:
            if isinstance(x, (dict, list)):
                stack.append((depth + 1, x))
            elif isinstance(x, float) and not math.isfinite(x):
                return False
    return True


def _levels_of(doc: Any, kind: str) -> list[tuple[tuple, dict]]:
    if kind == "result" and isinstance(doc.get("levels"), list):
        return [(("levels", i), lv) for i, lv in enumerate(doc["levels"]) if isinstance(lv, dict)]
    if kind == "aggregate" and isinstance(doc.get("runs"), list):
        return [(("runs", r, "levels", i), lv) for r, run in enumerate(doc["runs"]) if isinstance(run, dict)
                and isinstance(run.get("levels"), list) for i, lv in enumerate(run["levels"]) if isinstance(lv, dict)]
    return []


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def config_hash(config: dict[str, Any]) -> str:
    """The hash a job's result records of its resolved config (result.json's config_hash)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def semantic_errors(doc: Any, kind: str) -> list[str]:
    """Rules across fields: a job's config matches its config_hash (a result edited after it was written
    is refused); a level's errors never exceed its requests; a complete job has levels; byte sizes in the
    planner are not negative."""
    if not isinstance(doc, dict):
        return []
    out = []
    if kind == "result" and isinstance(doc.get("config"), dict) and isinstance(doc.get("config_hash"), str):
        try:
            actual = config_hash(doc["config"])
        except (TypeError, ValueError):
            actual = None
        if actual != doc["config_hash"]:
            out.append(f"$.config_hash: {doc['config_hash']} does not match the config this file holds (its hash is "
                       f"{actual}): the result was edited after it was written; measure it again")
    for parts, lv in _levels_of(doc, kind):
        n, e = lv.get("requests"), lv.get("errors")
        if _int(n) and _int(e) and e > n:
            out.append(f"{_path((*parts, 'errors'))}: {e} errors is more than the level's {n} requests")
        by_kind = lv.get("errors_by_kind")
        if _int(e) and isinstance(by_kind, dict) and all(_int(x) for x in by_kind.values()) \
                and sum(by_kind.values()) != e:
            out.append(f"{_path((*parts, 'errors_by_kind'))}: adds up to {sum(by_kind.values())}, not errors={e}")
    if kind == "result" and doc.get("status") == "complete" and doc.get("levels") == [] \
            and not isinstance(doc.get("quality"), dict):
        out.append("$.levels: a job whose status is complete must have at least one level (or, for a quality "
                   "scenario, a quality block)")
    if kind == "request":
        for a, b in (("sent_s", "done_s"), ("sent_s", "first_token_s")):
            x, y = doc.get(a), doc.get(b)
            if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y < x:
                out.append(f"$.{b}: {y} is before $.{a} {x}")
    planner = doc.get("planner")
    stack: list[tuple[tuple, Any, bool]] = [(("planner",), planner, False)] if isinstance(planner, dict) else []
    while stack:
        parts, v, sized = stack.pop()
        if isinstance(v, dict) and len(parts) < MAX_DEPTH:
            stack.extend(((*parts, k), x, sized or "bytes" in str(k)) for k, x in v.items())
        elif isinstance(v, list) and len(parts) < MAX_DEPTH:
            stack.extend(((*parts, i), x, sized) for i, x in enumerate(v))
        elif sized and isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0:
            out.append(f"{_path(parts)}: {v} is negative; a size in bytes must be >= 0")
    return sorted(out)


def errors_of(doc: Any, kind: str, structure: list[str] | None = None) -> list[str]:
    """Every violation as 'JSON-path: message': structure (depth, finite numbers) first, then the
    schema's, in document order, then the rules across fields. structure: structure_errors(doc), when
    the caller has it already."""
    structure = structure_errors(doc) if structure is None else structure
    if any("nested deeper" in m for m in structure):
        return structure  # the schema validator recurses: never hand it a document this deep
    errs = [] if accepts(kind)(doc) else sorted(validator(kind).iter_errors(doc),  # the fast check refused: ask
                                                key=lambda e: list(map(str, e.absolute_path)))  # jsonschema
    return structure + [f"{json_path(e)}: {e.message}" for e in errs] + semantic_errors(doc, kind)


def read_errors(doc: Any, kind: str, structure: list[str] | None = None) -> list[str]:
    """errors_of, and the sanity rules a file read must also pass (kvexp.results.guards.sanity_errors:
    percentiles in order, each level once, physical bounds, text lengths)."""
    errs = errors_of(doc, kind, structure)
    if any("nested deeper" in m for m in errs):
        return errs
    return errs + guards.sanity_errors(doc, kind)


def read_bounded(path: Path, limit: int | None = None) -> bytes:
    """A regular file's bytes, at most `limit` (MAX_FILE_BYTES): FileRefused for a device, FIFO or socket
    (`/dev/zero` would be read for ever; a FIFO is never opened) or a larger file; IsADirectoryError for a
    folder, other OSErrors as the system raises them."""
    return guards.read_regular(path, MAX_FILE_BYTES if limit is None else limit)


def parse_json(text: str | bytes) -> Any:
    """json.loads, with a nesting too deep for the decoder as a ValueError (not a RecursionError): found by
    a scan of the text before decoding, and the decoder's own RecursionError as a backstop."""
    too_deep = f"nested too deeply to decode (kvexp files nest at most {MAX_DEPTH} levels)"
    if guards.too_deep(text if isinstance(text, str) else text.decode("utf-8", "replace")):
        raise TooDeep(too_deep)
    try:
        return json.loads(text, object_pairs_hook=_object)
    except RecursionError:
        raise TooDeep(too_deep) from None
    except ValueError as e:
        if "integer string conversion" in str(e):  # Python's own text advises a setting of the interpreter
            raise ValueError(f"an integer of more than {sys.get_int_max_str_digits():,} digits: not a "
                             "measurement") from None
        raise


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object; one that gives a key twice is refused (readers disagree on which value counts)."""
    obj = dict(pairs)
    if len(obj) < len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"the key {twice!r} is given twice in one object, and readers disagree on which "
                         "value counts")
    return obj


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


@dataclass
class Inspected:
    """One file as read: its kind ("result", "aggregate", "request" for a requests.jsonl, "foreign" for
    another tool's file, "" when it could not be read as any), the parsed document (None when
    unreadable or a JSONL file) and every problem, each 'FILE: what is wrong' on one line."""

    kind: str
    doc: Any = None
    errors: list[str] = field(default_factory=list)


def inspect_file(path: Path, not_json: str = ": {}", whole_mapping: bool = True, jsonl: bool = True) -> Inspected:
    """Read and check one file the same way for every command: regular files only, bounded size and
    depth, its shape recognised (kvexp's own or another tool's), then its schema, sanity rules and, for
    another tool's file, the strict types of the fields kvexp maps. `not_json`: how a parse error is
    quoted after "not JSON"; whole_mapping: also group another tool's levels into a run alone (a file
    with no successful request cannot be, but can join others in `kvexp results`); jsonl: a file named
    *.jsonl is a requests.jsonl, checked line by line."""
    path = Path(path)
    if jsonl and path.suffix == ".jsonl":
        return Inspected("request", None, _check_jsonl(path))
    try:
        text = read_bounded(path).decode("utf-8")
    except FileRefused as e:
        return Inspected("", None, [str(e)])
    except IsADirectoryError:
        return Inspected("", None, [f"{path}: is a folder, not a result file"])
    except OSError as e:
        return Inspected("", None, [f"{path}: cannot read: {e.strerror}"])
    except UnicodeDecodeError:
        return Inspected("", None, [f"{path}: not JSON (not UTF-8 text)"])
    try:
        doc = parse_json(text)
    except TooDeep as e:
        return Inspected("", None, [f"{path}: {e}"])
    except ValueError as e:
        doc = json_lines_of(text)
        if _request_rows(doc):
            return Inspected("request", None, [_request_log(path)])
        if foreign.sniff(doc) is None:
            return Inspected("", None, [f"{path}: not JSON{not_json.format(e)}"])
    if _request_rows([doc]):  # a log of one request
        return Inspected("request", None, [_request_log(path)])
    structure = structure_errors(doc)  # (once: read_errors below is given it)
    deep = [m for m in structure if "nested deeper" in m]
    if deep:  # refused whatever its shape claims to be
        return Inspected("", None, [f"{path}: {deep[0]}"])
    if foreign.sniff(doc) is not None:
        return Inspected("foreign", doc, [f"{path}: {m}" for m in foreign_errors(doc, str(path), whole_mapping)])
    if not foreign.looks_like_kvexp(doc):
        return Inspected("", doc, [f"{path}: unknown shape: {foreign.EXPECTED}"])
    kind = kind_of(doc)
    version = doc.get("schema_version") if isinstance(doc, dict) else None
    if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
        return Inspected(kind, doc, [f"{path}: $.schema_version: {version} is newer than this kvexp understands "
                                     f"({SCHEMA_VERSION}); upgrade kvexp"])
    return Inspected(kind, doc, [f"{path}: {m}" for m in read_errors(doc, kind, structure)])


def _request_rows(docs: Any) -> bool:
    """Whether docs (parsed lines) are the lines of a requests.jsonl."""
    return isinstance(docs, list) and bool(docs) and all(isinstance(d, dict) and kind_of(d) == "request" for d in docs)


def _request_log(path: Path) -> str:
    return (f"{path}: a request log (requests.jsonl, one request per line), not a result: give its run folder "
            f"({path.parent}) or its result.json")


def check_file(path: Path) -> list[str]:
    """Violations of one file (JSON or JSONL), each 'FILE: JSON-path: message'. A job's result in the
    folder a run wrote (Hydra's .hydra/ beside it) must have its request log there, holding its levels."""
    path = Path(path)
    found = inspect_file(path)
    if found.kind == "result" and not found.errors and (path.parent / ".hydra").is_dir():
        if problem := request_log_problem(path.parent, found.doc):
            return [problem]
    return found.errors


def request_log_problem(folder: Path, doc: dict[str, Any]) -> str | None:
    """Why the request log a job's result names (`requests_file`, in its folder) does not hold the
    result's levels: missing, unreadable, or fewer measured lines for a level (and repeat) than the
    level's requests; None when it holds them or the result names none."""
    levels = [lv for lv in doc.get("levels") or [] if level_x(lv) is not None]
    name = doc.get("requests_file")
    if not name or not levels:
        return None
    path = folder / name
    if not path.exists():
        return (f"{path}: missing: the request log of the {len(levels)} level(s) in {folder / 'result.json'} "
                "(their requests cannot be read or resumed)")
    counts: Counter = Counter()
    try:
        for _, raw in guards.regular_lines(path, guards.MAX_JSONL_BYTES, MAX_LINE_BYTES):
            try:
                row = parse_json(raw.decode("utf-8"))
                if not row.get("warmup"):
                    counts[(float(row["level"]), int(row["repeat"]))] += 1
            except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
                continue  # a bad line: validate names it when given the log itself
    except (FileRefused, OSError) as e:
        return f"{path}: cannot read: {getattr(e, 'strerror', None) or e}"
    for lv in levels:
        kind, x = level_x(lv)
        repeat, want = int(lv.get("repeat") or 0), int(lv.get("requests") or 0)
        if counts[(x, repeat)] < want:
            return (f"{path}: {counts[(x, repeat)]} request line(s) for {kind} {x:g}"
                    f"{f' (repeat {repeat})' if repeat else ''}, whose level in {folder / 'result.json'} "
                    f"counts {want}: the log was cut or edited")
    return None


def json_lines_of(text: str) -> Any:
    """One JSON object per line (`vllm bench serve --append-result`), else None."""
    try:
        docs = [parse_json(ln) for ln in text.splitlines() if ln.strip()]
    except ValueError:
        return None
    return docs if len(docs) > 1 else None


def foreign_errors(doc: Any, source: str, whole_mapping: bool = True) -> list[str]:
    """Why another tool's file cannot be mapped to kvexp's levels, or its mapping breaks the aggregate
    schema or kvexp's sanity rules; [] when it maps cleanly. The fields kvexp reads are checked first,
    each problem named by the tool's own field."""
    fields = field_errors(doc)
    if fields:
        return fields
    try:
        levels = foreign.levels_of(doc, source)
    except foreign.ForeignFormatError as e:
        return [str(e)]
    try:
        runs = foreign.runs_of(levels)
    except foreign.ForeignFormatError as e:
        if whole_mapping:
            return [str(e)]
        return [m for i, lv in enumerate(levels) for m in guards.level_errors(("levels", i), lv.level)]
    return read_errors({"gpu": None, "gpu_gib": None, "runs": [r.to_json() for r in runs]}, "aggregate")


def _check_jsonl(path: Path) -> list[str]:
    """Line by line, each at most MAX_LINE_BYTES, the file at most guards.MAX_JSONL_BYTES: a file of any
    length is read in bounded memory; a FIFO or device is refused before it is opened."""
    out: list[str] = []
    try:
        for n, raw in guards.regular_lines(path, guards.MAX_JSONL_BYTES, MAX_LINE_BYTES):
            if len(raw) > MAX_LINE_BYTES:
                return out + [f"{path}:{n}: line longer than {guards.size_text(MAX_LINE_BYTES)}; not a kvexp file"]
            if not raw.strip():
                continue
            try:
                doc = parse_json(raw.decode("utf-8"))
            except (ValueError, UnicodeDecodeError) as e:
                cut = not raw.endswith(b"\n")
                out.append(f"{path}:{n}: not JSON: {e}" + (" (the last line, cut short)" if cut else ""))
                continue
            out += [f"{path}:{n}: {m}" for m in errors_of(doc, "request")]
    except FileRefused as e:
        return [str(e)]
    except IsADirectoryError:
        return [f"{path}: is a folder, not a result file"]
    except OSError as e:
        return [f"{path}: cannot read: {e.strerror}"]
    return out
