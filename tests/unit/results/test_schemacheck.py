"""The schemas' fast check (kvexp.results.schemacheck) never accepts what jsonschema refuses, and accepts
kvexp's real documents (otherwise it saves nothing): checked on the real fixtures and on thousands of
seeded mutations of them (keys removed, added, retyped, numbers out of range)."""

from __future__ import annotations

import copy
import json
import random

import pytest
from conftest import FIXTURES

from kvexp.analysis.aggregate import collect
from kvexp.results import validate
from kvexp.results.schemacheck import compile_schema

RESULTS = sorted(FIXTURES.glob("decision/*/result.json")) + [FIXTURES / "foreign" / "kvexp" / "result.json"]
ODD = (None, True, False, 0, -1, 1.5, -0.5, 1e300, "", "x", "kvexp.job", [], [1], {}, {"a": 1}, float("nan"),
       2**70, "q8_0")


def _documents() -> list[tuple[str, dict]]:
    docs = [("result", json.loads(p.read_text())) for p in RESULTS]
    docs.append(("aggregate", collect(RESULTS).to_json()))
    docs.append(("aggregate", json.loads((FIXTURES / "rtx5070ti-qwen2.5-7b.json").read_text())))
    docs.append(("request", {"index": 0, "level": 1.0, "repeat": 0, "warmup": False, "sent_s": 0.1,
                             "first_token_s": 0.2, "done_s": 0.4, "token_times_s": [0.2, 0.3, 0.4],
                             "prompt_tokens": 32, "output_tokens": 3, "error_kind": None, "error": None}))
    return docs


def _paths(doc, prefix=()):
    yield prefix
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for k, v in items:
        yield from _paths(v, (*prefix, k))


def _mutate(doc, rng: random.Random):
    doc = copy.deepcopy(doc)
    paths = [p for p in _paths(doc) if p]
    for _ in range(rng.choice((1, 1, 2, 3))):
        path = rng.choice(paths)
        how = rng.random()
        try:
            parent = doc
            for k in path[:-1]:
                parent = parent[k]
            key = path[-1]
            if how < 0.25 and isinstance(parent, dict):
                del parent[key]
            elif how < 0.35 and isinstance(parent, dict):
                parent[rng.choice(("extra", "kind", f"{key}_x"))] = rng.choice(ODD)
            elif how < 0.45 and isinstance(parent[key], (int, float)) and not isinstance(parent[key], bool):
                parent[key] = -parent[key] - 1
            else:
                parent[key] = rng.choice(ODD)
        except (KeyError, IndexError, TypeError):
            continue
    return doc


@pytest.mark.parametrize("kind,doc", _documents(), ids=lambda x: x if isinstance(x, str) else "")
def test_accepts_real_documents(kind, doc):
    assert validate.validator(kind).is_valid(doc)
    assert validate.accepts(kind)(doc)


def test_never_accepts_what_jsonschema_refuses():
    rng = random.Random(36)
    refused = valid_ones = accepted = 0
    for kind, doc in _documents():
        check, judge = validate.accepts(kind), validate.validator(kind)
        for _ in range(200 if kind != "aggregate" else 60):
            bad = _mutate(doc, rng)
            valid = judge.is_valid(bad)
            if check(bad):
                assert valid, f"{kind}: accepted a document jsonschema refuses: {list(judge.iter_errors(bad))[:1]}"
            refused += not valid
            valid_ones += valid
            accepted += check(bad)
    assert refused > 300 and valid_ones > 60  # the mutations broke documents, and left others valid
    assert accepted > 0.9 * valid_ones  # which the check accepts itself (else it saves nothing)


def test_unknown_keywords_and_references_refuse():
    assert not compile_schema({"type": "object", "patternProperties": {"^x": {}}})({"x": 1})
    assert not compile_schema({"$ref": "#/$defs/missing"})({})
    assert not compile_schema({"$ref": "other.json"})({})
    assert not compile_schema({"type": "strange"})(1)
    assert compile_schema({"type": "integer", "minimum": 0})(3.0)  # jsonschema: 3.0 is an integer
    assert not compile_schema({"enum": [1]})(True)  # true is not 1
    assert compile_schema({"enum": [1]})(1.0)
    tree = {"$defs": {"node": {"type": "object", "properties": {"next": {"anyOf": [{"type": "null"},
                                                                                  {"$ref": "#/$defs/node"}]}},
                               "additionalProperties": False}}, "$ref": "#/$defs/node"}
    assert compile_schema(tree)({"next": {"next": None}})
    assert not compile_schema(tree)({"next": {"next": 1}})
