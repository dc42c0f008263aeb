"""Hostile input to validate, report, resume and the experiment itself: each case is one line naming the
file (and the field) and exit status 1, never a traceback. Broken configs are in test_config.py."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

from conftest import with_tiny, TINY

from kvexp.app.cli import main

from kvexp.app.compose import compose, safe_name
from kvexp.metrics.records import RequestRecord
from kvexp.measure.runner import unrun_result

LEVEL = {"concurrency": 1, "requests": 8, "errors": 0, "throughput_tok_s": 10.0, "ttft_p50_ms": 1.0,
         "ttft_p95_ms": 2.0, "tpot_p50_ms": 1.0, "peak_vram_gib": None, "peak_kv_cache_usage": None,
         "preemptions": None, "mean_prompt_tokens": 32, "status": "ok", "repeat": 0}
REQUEST = RequestRecord(index=0, level=1, sent_s=0.1, first_token_s=0.15, done_s=0.2, token_times_s=[0.15]).to_json()


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, Any]:
    """A valid job result (a skipped job, plus one level)."""
    doc = unrun_result(compose(TINY), tmp_path_factory.mktemp("good"), "for the tests").to_json()
    doc["levels"] = [dict(LEVEL)]
    return doc


def put(path: Path, content: Any) -> str:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def folder_with(folder: Path, name: str, content: Any) -> str:
    put(folder / name, content)
    return str(folder)


def changed(doc: dict[str, Any], edit: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    edit(doc)
    return doc


# (name, argv builder given (folder, valid result), the one line expected, {F} = the file named first)
CASES: list[tuple[str, Callable[[Path, dict], list[str]], str]] = [
    ("validate: not JSON", lambda d, g: ["validate", put(d / "r.json", "{not json")],
     "{F}: not JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    ("validate: empty file", lambda d, g: ["validate", put(d / "r.json", "")],
     "{F}: not JSON: Expecting value: line 1 column 1 (char 0)"),
    ("validate: not UTF-8", lambda d, g: ["validate", put(d / "r.json", b"\xff\xfe{}")],
     "{F}: not JSON (not UTF-8 text)"),
    ("validate: an array", lambda d, g: ["validate", put(d / "r.json", [1, 2])],
     "{F}: $: [1, 2] is not of type 'object'"),
    ("validate: a future schema version", lambda d, g: ["validate", put(d / "r.json", {**g, "schema_version": 3})],
     "{F}: $.schema_version: 3 is newer than this kvexp understands (2); upgrade kvexp"),
    ("validate: a missing field", lambda d, g: ["validate", put(d / "r.json", changed(g, lambda x: x.pop("label")))],
     "{F}: $: 'label' is a required property"),
    ("validate: a wrong type", lambda d, g: ["validate", put(d / "r.json", changed(
        g, lambda x: x["levels"][0].update(requests="8")))],
     "{F}: $.levels[0].requests: '8' is not of type 'integer'"),
    ("validate: an unknown status", lambda d, g: ["validate", put(d / "r.json", {**g, "status": "done"})],
     "{F}: $.status: 'done' is not one of ['complete', 'partial', 'failed', 'skipped']"),
    ("validate: no such file", lambda d, g: ["validate", str(d / "nope.json")],
     "{F}: cannot read: No such file or directory"),
    ("validate: a folder without results", lambda d, g: ["validate", str(d)], "{F}: no result.json found in this folder"),
    ("validate: requests.jsonl with a cut line", lambda d, g: ["validate", put(
        d / "requests.jsonl", json.dumps(REQUEST) + '\n{"index": 1, "lev')],
     "{F}:2: not JSON: Unterminated string starting at: line 1 column 14 (char 13)"),
    ("validate: requests.jsonl with a wrong type", lambda d, g: ["validate", put(
        d / "requests.jsonl", json.dumps({**REQUEST, "sent_s": "soon"}) + "\n")],
     "{F}:1: $.sent_s: 'soon' is not of type 'number', 'null'"),
    ("validate: no file given", lambda d, g: ["validate"],
     "kvexp validate: the following arguments are required: files"),
    ("report: no such path", lambda d, g: ["report", str(d / "nope")], "kvexp: {F}: no such file or folder"),
    ("report: a folder without results", lambda d, g: ["report", str(d)],
     "kvexp: {F}: no result.json found in this folder"),
    ("report: a result that is not JSON", lambda d, g: ["report", put(d / "result.json", "[1,")],
     "kvexp: {F}: not JSON (Expecting value: line 1 column 4 (char 3))"),
    ("report: a result that is not UTF-8", lambda d, g: ["report", put(d / "result.json", b"\x80")],
     "kvexp: {F}: not JSON (not UTF-8 text)"),
    ("report: a result of a future schema", lambda d, g: ["report", put(d / "result.json", {**g, "schema_version": 3})],
     "kvexp: {F}: $.schema_version: 3 is newer than this kvexp understands (2); upgrade kvexp"),
    ("report: a result missing a field", lambda d, g: ["report", put(d / "result.json", changed(
        g, lambda x: x["backend"].pop("name")))],
     "kvexp: {F}: $.backend: 'name' is a required property"),
    ("report: a result with a wrong type", lambda d, g: ["report", put(d / "result.json", changed(
        g, lambda x: x["levels"][0].update(errors=-1)))],
     "kvexp: {F}: $.levels[0].errors: -1 is less than the minimum of 0"),
    ("report: --out is a file", lambda d, g: ["report", put(d / "result.json", g), "--out", put(d / "out", "x")],
     "kvexp: --out {D}/out: cannot make this folder: File exists"),
    ("report: an unknown option", lambda d, g: ["report", str(d), "--bogus"],
     "kvexp report: unrecognized arguments: --bogus"),
    ("resume: no such folder", lambda d, g: ["resume", str(d / "nope")], "kvexp: {F}: no such folder"),
    ("resume: a file", lambda d, g: ["resume", put(d / "result.json", g)], "kvexp: {F}: not a folder"),
    ("resume: not a sweep folder", lambda d, g: ["resume", str(d)],
     "kvexp: {F}: not a kvexp sweep or run folder (no multirun.yaml or .hydra/hydra.yaml)"),
    ("resume: a broken multirun.yaml", lambda d, g: ["resume", folder_with(d, "multirun.yaml", "hydra: [")],
     "kvexp: {D}/multirun.yaml: hydra.overrides: cannot read the saved overrides"),
    ("run: an API key variable that is not set", lambda d, g: ["backend.endpoint=http://127.0.0.1:9",
                                                              "backend.api_key_env=KVEXP_TEST_UNSET_KEY"],
     "kvexp: backend.api_key_env=KVEXP_TEST_UNSET_KEY: that environment variable is not set"),
    ("run: a misspelt command", lambda d, g: ["valdate", str(d)],
     "kvexp: valdate: neither a command (validate, report, plan, install, resume, results, cleanup) nor an override key=value"),
    ("install: an unknown server", lambda d, g: ["install", "tgi"],
     "kvexp install: argument what: invalid choice: 'tgi' (choose from 'llamacpp', 'vllm', 'ollama', 'smollm2', 'gemma3')"),
]


@pytest.mark.parametrize("name,argv,expected", CASES, ids=[c[0] for c in CASES])
def test_one_line_and_exit_1(name, argv, expected, good, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KVEXP_TEST_UNSET_KEY", raising=False)
    args = argv(tmp_path, good)
    files = [a for a in args[1:] if a.startswith(str(tmp_path))]
    with pytest.raises(SystemExit) as e:
        sys.exit(main(args))
    assert e.value.code == 1
    out, err = capsys.readouterr()
    lines = (out + err).strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(expected.format(F=files[0] if files else "", D=tmp_path)), lines[0]
    assert not (tmp_path / "outputs").exists()


def test_an_unreadable_file(good, tmp_path, capsys, monkeypatch):
    path = Path(put(tmp_path / "result.json", good))
    import builtins

    real_open = builtins.open

    def refuse(file: Any, *a: Any, **k: Any) -> Any:
        if str(file) == str(path):  # as root, chmod 000 would not stop a read
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *a, **k)

    monkeypatch.setattr(builtins, "open", refuse)
    assert main(["validate", str(path)]) == 1
    assert capsys.readouterr().out == f"{path}: cannot read: Permission denied\n"
    assert main(["report", str(path)]) == 1
    assert capsys.readouterr().err == f"kvexp: {path}: cannot read: Permission denied\n"


@pytest.mark.parametrize("args,expected", [
    (["validate", "."], ".: no result.json found in this folder"),
    (["report", "missing-folder"], "kvexp: missing-folder: no such file or folder"),
])
def test_no_traceback_from_the_command_line(tmp_path, args, expected):
    p = subprocess.run([sys.executable, "-m", "kvexp", *with_tiny(args)], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 1
    assert (p.stdout + p.stderr).strip() == expected


@pytest.mark.parametrize("label,expected", [
    ("../../etc/passwd", "etc_passwd"), ("..", "job"), ("a b;rm -rf ~", "a_b_rm_-rf"), ("$(reboot)`x`", "reboot_x"),
    ("llamacpp-tiny-q8_0-smoke", "llamacpp-tiny-q8_0-smoke"),
])
def test_labels_are_safe_file_names(label, expected):
    assert safe_name(label) == expected
