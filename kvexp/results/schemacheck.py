"""A fast yes/no check of a document against one of kvexp's own JSON Schemas.

    accepts = compile_schema(schema)   # once per schema
    accepts(doc) -> True only when the schema accepts doc

jsonschema's validator walks a schema keyword by keyword through a generic machinery (a new validator
object per subschema, a reference resolver, an error object per failure): about 0.1 ms per level, so
reading a thousand results spent a minute in it. A schema compiled once into nested closures checks the
same document a hundred times faster. It is only ever the fast path: it knows the keywords kvexp's
schemas use, compiles any other keyword (and any reference it cannot resolve) to "refuse", and the
caller (kvexp.results.validate.errors_of) asks jsonschema whenever it refuses, so jsonschema remains the
judge and the author of every message. What it accepts, jsonschema accepts: each keyword below keeps
jsonschema's draft 2020-12 meaning, and keywords that only annotate are ignored."""

from __future__ import annotations

import re
from typing import Any, Callable

Check = Callable[[Any], bool]

ANNOTATIONS = frozenset(("$schema", "$id", "$comment", "$defs", "title", "description", "default", "examples",
                         "deprecated", "readOnly", "writeOnly"))


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_TYPES: dict[str, Check] = {
    "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
    "number": _is_number,
    "string": lambda v: isinstance(v, str),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def _refuse(_: Any) -> bool:
    return False


def _equal(a: Any, b: Any) -> bool:
    """JSON equality as jsonschema's enum and const mean it: true is not 1, 1 is 1.0."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if _is_number(a) and _is_number(b):
        return a == b
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


SCALAR = frozenset(("type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"))
OBJECT = frozenset(("type", "properties", "required", "additionalProperties"))
_NUMBER_TYPES = (int, float)  # by exact type: bool, an int subclass, is not a number here


def _scalar(s: dict[str, Any]) -> Check | None:
    """The commonest schema, {"type": [...], "minimum": ...}, as one closure; None for other types."""
    names = s.get("type", ["number"])
    names = [names] if isinstance(names, str) else names
    if not set(names) <= {"number", "null", "integer"} or not names:
        return None
    nullable, integer, number = "null" in names, "integer" in names and "number" not in names, "number" in names
    if not (number or integer):
        return None
    lo, hi = s.get("minimum"), s.get("maximum")
    xlo, xhi = s.get("exclusiveMinimum"), s.get("exclusiveMaximum")
    if any(b is not None and not _is_number(b) for b in (lo, hi, xlo, xhi)):
        return None

    def check(v: Any) -> bool:
        if v is None:
            return nullable
        t = type(v)
        if t is int:
            pass
        elif t is float:
            if integer and not v.is_integer():
                return False
        else:
            return False
        return ((lo is None or v >= lo) and (hi is None or v <= hi) and (xlo is None or v > xlo)
                and (xhi is None or v < xhi))

    return check


def compile_schema(root: dict[str, Any]) -> Check:
    """The check for a whole schema (its $defs reachable through local "#/..." references)."""
    compiled: dict[str, Check] = {}

    def ref(pointer: str) -> Check:
        if pointer not in compiled:
            target: Any = root
            if not pointer.startswith("#"):
                return _refuse
            for part in [p for p in pointer[1:].split("/") if p]:
                part = part.replace("~1", "/").replace("~0", "~")
                if not isinstance(target, dict) or part not in target:
                    return _refuse
                target = target[part]
            compiled[pointer] = _refuse  # a reference to itself while it compiles: resolved below
            checks: list[Check] = []
            compiled[pointer] = lambda v: all(c(v) for c in checks)
            checks.append(build(target))
        return compiled[pointer]

    def build(s: Any) -> Check:
        if s is True:
            return lambda v: True
        if not isinstance(s, dict):
            return _refuse
        keys = set(s) - ANNOTATIONS
        if keys and keys <= SCALAR and isinstance(s.get("type", "number"), (str, list)):
            fast = _scalar(s)
            if fast is not None:
                return fast
        if keys and "properties" in keys and keys <= OBJECT and s.get("type") == "object":
            return _object(s)
        checks = [c for key in keys if (c := keyword(key, s[key], s)) is not None]
        if not checks:
            return lambda v: True
        if len(checks) == 1:
            return checks[0]
        return lambda v: all(c(v) for c in checks)

    def _object(s: dict[str, Any]) -> Check:
        """An object schema (properties, required, additionalProperties) as one loop over its members."""
        props = {k: build(x) for k, x in s["properties"].items()}
        need = tuple(s.get("required") or ())
        extra_arg = s.get("additionalProperties", True)
        extra = None if extra_arg is True or extra_arg is False else build(extra_arg)
        closed = extra_arg is False

        def check(v: Any) -> bool:
            if not isinstance(v, dict):
                return False
            for k in need:
                if k not in v:
                    return False
            for k, x in v.items():
                c = props.get(k)
                if c is None:
                    if closed or (extra is not None and not extra(x)):
                        return False
                elif not c(x):
                    return False
            return True

        return check

    def keyword(key: str, arg: Any, s: dict[str, Any]) -> Check | None:
        if key == "type":
            names = [arg] if isinstance(arg, str) else arg
            if not isinstance(names, list) or any(n not in _TYPES for n in names):
                return _refuse
            tests = [_TYPES[n] for n in names]
            return tests[0] if len(tests) == 1 else (lambda v: any(t(v) for t in tests))
        if key == "properties":
            props = {k: build(x) for k, x in arg.items()}
            return lambda v: not isinstance(v, dict) or all(c(v[k]) for k, c in props.items() if k in v)
        if key == "required":
            need = tuple(arg)
            return lambda v: not isinstance(v, dict) or all(k in v for k in need)
        if key == "additionalProperties":
            if "patternProperties" in s:
                return _refuse
            known = frozenset(s.get("properties") or ())
            if arg is False:
                return lambda v: not isinstance(v, dict) or known.issuperset(v)
            extra = build(arg)
            return lambda v: not isinstance(v, dict) or all(extra(x) for k, x in v.items() if k not in known)
        if key == "propertyNames":
            name = build(arg)
            return lambda v: not isinstance(v, dict) or all(name(k) for k in v)
        if key == "items":
            if not isinstance(arg, dict) and arg is not True:
                return _refuse
            item = build(arg)
            return lambda v: not isinstance(v, list) or all(item(x) for x in v)
        if key in ("enum", "const"):
            options = list(arg) if key == "enum" else [arg]
            if all(isinstance(o, str) for o in options):
                allowed = frozenset(options)
                return lambda v: isinstance(v, str) and v in allowed
            return lambda v: any(_equal(v, o) for o in options)
        if key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if not _is_number(arg):
                return _refuse
            op = {"minimum": lambda x: x >= arg, "maximum": lambda x: x <= arg,
                  "exclusiveMinimum": lambda x: x > arg, "exclusiveMaximum": lambda x: x < arg}[key]
            return lambda v: not _is_number(v) or op(v)
        if key in ("minLength", "maxLength", "minItems", "maxItems"):
            kind = str if key.endswith("Length") else list
            bound = (lambda n: n >= arg) if key.startswith("min") else (lambda n: n <= arg)
            return lambda v: not isinstance(v, kind) or bound(len(v))
        if key == "pattern":
            rx = re.compile(arg)
            return lambda v: not isinstance(v, str) or rx.search(v) is not None
        if key == "anyOf":
            options_ = [build(x) for x in arg]
            return lambda v: any(c(v) for c in options_)
        if key == "$ref":
            return ref(arg) if isinstance(arg, str) else _refuse
        return _refuse  # a keyword this check does not know: jsonschema decides

    return build(root)
