"""One reading path for every command: each hostile or nonsensical file below gets the same answer from
`validate`, `results` and `report`, run as `python -m kvexp` in a subprocess with a timeout (a hang fails
the test): exit status 1, one line naming the file and what is wrong (validate: one line per problem),
never a traceback, never a report."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import FIXTURES, ROOT

FIX = FIXTURES / "foreign"
KVEXP_RESULT = FIX / "kvexp" / "result.json"
VLLM = FIX / "vllm" / "tiny-vllm-concurrency1.json"
GUIDELLM = FIX / "guidellm" / "benchmarks.json"
AIPERF = FIX / "aiperf" / "concurrency1" / "profile_export_aiperf.json"
TIMEOUT_S = 120  # far above what a refusal takes; reached only by a hang


def kvexp(*args: str, cwd: Path) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-m", "kvexp", *args], capture_output=True, text=True, cwd=cwd,
                       timeout=TIMEOUT_S, env=env)
    return p.returncode, p.stdout + p.stderr


def edited(src: Path, edit: Callable[[Any], Any]) -> Any:
    doc = json.loads(src.read_text())
    out = edit(doc)
    return doc if out is None else out


def _result(edit: Callable[[dict], Any]) -> Callable[[Path], Path]:
    def make(d: Path) -> Path:
        p = d / "result.json"
        p.write_text(json.dumps(edited(KVEXP_RESULT, edit)))
        return p
    return make


def _tool(src: Path, edit: Callable[[Any], Any], name: str = "bench.json") -> Callable[[Path], Path]:
    def make(d: Path) -> Path:
        p = d / name
        p.write_text(json.dumps(edited(src, edit)))
        return p
    return make


def _text(edit: Callable[[str], str]) -> Callable[[Path], Path]:
    """A valid result whose JSON text is edited (what json.dumps cannot write)."""
    def make(d: Path) -> Path:
        p = d / "result.json"
        p.write_text(edit(KVEXP_RESULT.read_text()))
        return p
    return make


def _fifo(d: Path) -> Path:
    os.mkfifo(d / "x.json")
    return d / "x.json"


def _zero(d: Path) -> Path:
    (d / "zero.json").symlink_to("/dev/zero")
    return d / "zero.json"


def _deep(d: Path) -> Path:
    (d / "deep.json").write_text("[" * 200_000 + "]" * 200_000)
    return d / "deep.json"


def _huge(d: Path) -> Path:
    p = d / "huge.json"
    with open(p, "wb") as f:
        f.truncate((64 << 20) + 1)  # sparse: no disk, and refused from its size before any read
    return p


def _appended(d: Path) -> Path:
    one = json.loads(VLLM.read_text())
    two = {**one, "max_concurrency": 2, "failed": 10 ** 9}
    p = d / "appended.json"
    p.write_text(json.dumps(one) + "\n" + json.dumps(two) + "\n")
    return p


def _dup(doc: dict) -> None:
    doc["levels"].append(copy.deepcopy(doc["levels"][0]))


def _many_levels(doc: dict) -> None:
    """More levels than a job may measure: its report would lay out each (4,000 took minutes and 4 GB)."""
    doc["levels"] = [{**copy.deepcopy(doc["levels"][0]), "concurrency": i} for i in range(1, 1026)]


def _guidellm_p50(doc: dict) -> None:
    doc["benchmarks"][0]["metrics"]["time_to_first_token_ms"]["successful"]["percentiles"]["p50"] = "fast"


def _aiperf_order(doc: dict) -> None:
    doc["time_to_first_token"]["p50"] = doc["time_to_first_token"]["p99"] * 2


# (name, the file, what its one line says after "FILE: ")
CASES: list[tuple[str, Callable[[Path], Path], str]] = [
    ("a FIFO named x.json", _fifo, "not a regular file (a device, FIFO or socket); not a kvexp file"),
    ("a symlink to /dev/zero", _zero, "not a regular file (a device, FIFO or socket); not a kvexp file"),
    ("200,000 nested [", _deep, "nested too deeply to decode (kvexp files nest at most 32 levels)"),
    ("a file over 64 MiB", _huge, "larger than 64 MiB"),
    ("vLLM: failed 1000000000", _tool(VLLM, lambda d: d.update(failed=10 ** 9)),
     "$.failed: 1000000000 failed + 16 completed requests is more than the 16 prompts the run sent (num_prompts)"),
    ("vLLM: max_concurrency -8", _tool(VLLM, lambda d: d.update(max_concurrency=-8)),
     "$.max_concurrency: expected a whole number of requests in flight >= 1 (or null: no limit), found -8"),
    ("vLLM: max_concurrency 'eight'", _tool(VLLM, lambda d: d.update(max_concurrency="eight")),
     "$.max_concurrency: expected a whole number of requests in flight >= 1 (or null: no limit), found 'eight'"),
    ("vLLM: median_ttft_ms 'fast'", _tool(VLLM, lambda d: d.update(median_ttft_ms="fast")),
     "$.median_ttft_ms: expected a number, found 'fast'"),
    ("vLLM: a bad line of an appended file", _appended, "$[1].failed: 1000000000 failed + 16 completed requests"),
    ("GuideLLM: a p50 of 'fast'", _tool(GUIDELLM, _guidellm_p50),
     "$.benchmarks[0].metrics.time_to_first_token_ms.successful.percentiles.p50: expected a number, found 'fast'"),
    ("AIPerf: p50 above p99", _tool(AIPERF, _aiperf_order), "$.time_to_first_token.p50: "),
    ("GuideLLM: a benchmark's config a string", _tool(GUIDELLM, lambda d: d["benchmarks"][0].update(config="x")),
     "GuideLLM file with a field of a shape that tool does not write (AttributeError"),
    ("GuideLLM: a start time of 1e300", _tool(GUIDELLM, lambda d: d["benchmarks"][0].update(start_time=1e300)),
     "GuideLLM file with a field of a shape that tool does not write (OverflowError"),
    ("AIPerf: phases a number", _tool(AIPERF, lambda d: d["input_config"].update(phases=5)),
     "AIPerf file with a field of a shape that tool does not write (TypeError"),
    ("kvexp: TTFT p50 above p95", _result(lambda d: d["levels"][0].update(ttft_p50_ms=1000.0)),
     "$.levels[0].ttft_p50_ms: 1000 is above ttft_p95_ms 37.98; a lower percentile cannot exceed a higher one"),
    ("kvexp: TPOT p95 above p99", _result(lambda d: d["levels"][1].update(tpot_p95_ms=99.0)),
     "$.levels[1].tpot_p95_ms: 99 is above tpot_p99_ms"),
    ("kvexp: a level twice", _result(_dup),
     "$.levels[3]: concurrency 1, repeat 0 again (first at $.levels[0]); a run measures each level and repeat once"),
    ("kvexp: 1,025 levels", _result(_many_levels),
     "$.levels: 1,025 levels, more than the 1,024 (levels x repeats) a kvexp job measures"),
    ("kvexp: repeat 1,000,000", _result(lambda d: d["levels"][0].update(repeat=1_000_000)),
     "$.levels[0].repeat: 1,000,000 is beyond the 1,000 repeats a job may have"),
    ("kvexp: a 5 MB label", _result(lambda d: d.update(label="L" * 5_000_000)),
     "$.label: 5000000 characters, more than the 1000 a name may have"),
    ("kvexp: a label that clears the terminal", _result(lambda d: d.update(label="a\x1b[2Jb")),
     "$.label: '\\x1b' at position 1: a name is shown in tables, logs and terminals"),
    ("vLLM: a model name with a newline", _tool(VLLM, lambda d: d.update(model_id="m\nX")),
     "$.model_id: '\\n' at position 1: a name is shown in tables, logs and terminals"),
    ("kvexp: throughput 1e300", _result(lambda d: d["levels"][0].update(throughput_tok_s=1e300)),
     "$.levels[0].throughput_tok_s: 1e+300 tok/s is above 1e+07 tok/s"),
    ("kvexp: a negative count", _result(lambda d: d["levels"][0].update(output_tokens=-5)),
     "$.levels[0].output_tokens: -5 is less than the minimum of 0"),
]


@pytest.mark.parametrize("name,make,expected", CASES, ids=[c[0] for c in CASES])
def test_every_command_refuses_it_in_one_line(name, make, expected, tmp_path):
    path = make(tmp_path)
    rc, out = kvexp("validate", str(path), cwd=tmp_path)
    lines = out.strip().splitlines()
    assert rc == 1 and "Traceback" not in out, out[-2000:]
    assert lines and all(ln.startswith(f"{path}: ") for ln in lines), out[-2000:]
    assert lines[0].startswith(f"{path}: {expected}"), lines[0][:500]
    assert all(len(ln) < 1000 for ln in lines)  # a 5 MB value is never quoted whole
    for command in (["results", str(path)], ["report", str(path), "--out", str(tmp_path / "report")]):
        rc, out = kvexp(*command, cwd=tmp_path)
        assert rc == 1 and "Traceback" not in out, (command[0], out[-2000:])
        (line,) = out.strip().splitlines()
        assert line.startswith(f"kvexp: {path}: {expected}"), (command[0], line[:500])
        more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
        assert line == f"kvexp: {lines[0]}{more}", (command[0], line[:500])  # the same answer as validate
    assert not (tmp_path / "report").exists()


def test_validate_lists_every_problem_of_a_tool_file(tmp_path):
    path = _tool(VLLM, lambda d: d.update(max_concurrency=-8, median_ttft_ms="fast", failed=10 ** 9))(tmp_path)
    rc, out = kvexp("validate", str(path), cwd=tmp_path)
    assert rc == 1
    assert out.strip().splitlines() == [
        f"{path}: $.max_concurrency: expected a whole number of requests in flight >= 1 (or null: no limit), found -8",
        f"{path}: $.median_ttft_ms: expected a number, found 'fast'",
        f"{path}: $.failed: 1000000000 failed + 16 completed requests is more than the 16 prompts the run sent "
        "(num_prompts)",
    ]
    rc, out = kvexp("results", str(path), cwd=tmp_path)
    assert rc == 1 and out.strip().endswith("(and 2 more)") and len(out.strip().splitlines()) == 1


def test_a_folder_with_a_fifo_and_a_device_link_is_read_without_them(tmp_path):
    """`results` on a folder lists other tools' *.json files: one that is a FIFO or a link to /dev/zero is
    not one (and is never opened for reading); the folder's real files still read."""
    folder = tmp_path / "mixed"
    folder.mkdir()
    for src in sorted((FIX / "vllm").glob("*.json")):
        (folder / src.name).write_bytes(src.read_bytes())
    _fifo(folder)
    _zero(folder)
    rc, out = kvexp("results", str(folder), "--csv", cwd=tmp_path)
    assert rc == 0 and "Traceback" not in out, out[-2000:]
    assert len(out.strip().splitlines()) == 4  # the header and the three levels


def test_the_valid_fixtures_still_read_with_every_command(tmp_path):
    files = [str(p) for p in sorted(FIX.rglob("*.json"))]
    rc, out = kvexp("validate", *files, cwd=tmp_path)
    assert rc == 0 and out.count(": valid\n") == len(files) == 8, out
    rc, out = kvexp("results", str(FIX), cwd=tmp_path)
    assert rc == 0 and "12 row(s) from 4 run(s)" in out, out
    rc, out = kvexp("report", str(FIX), "--out", str(tmp_path / "rep"), cwd=tmp_path)
    assert rc == 0 and (tmp_path / "rep" / "report.md").is_file(), out[-2000:]


@pytest.mark.parametrize("edit, why", [
    (lambda t: t.replace('"label":', '"label": "other", "label":', 1),
     "the key 'label' is given twice in one object, and readers disagree on which value counts"),
    (lambda t: t.replace('"label":', '"n": ' + "9" * 5000 + ', "label":', 1),
     "an integer of more than 4,300 digits: not a measurement"),
], ids=["a key twice", "5,000 digits"])
def test_json_that_readers_would_take_differently_is_refused(tmp_path, edit, why):
    """A key given twice was read as valid (the last value won, silently); a 5,000-digit number was refused
    with Python's advice to change an interpreter setting."""
    path = _text(edit)(tmp_path)
    rc, out = kvexp("validate", str(path), cwd=tmp_path)
    assert rc == 1 and out.strip() == f"{path}: not JSON: {why}", out
    rc, out = kvexp("results", str(path), cwd=tmp_path)
    assert rc == 1 and out.strip() == f"kvexp: {path}: not JSON ({why})", out
