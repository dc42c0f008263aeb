"""What the command line tells a reviewer: a sweep runs what it can and says at its start which pairs it
skips and why; keys only some backends of a sweep declare are set where declared and ignored, once
said, elsewhere; resume of a finished folder has nothing to do; validate takes folders; --help lists
every command; results prints an aligned table (CSV on request); the client-workers advice names the
likely cause. Jobs run on the fake llama-server (tests/support/fake_openai.py)."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SUBCOMMANDS, TINY, kvexp_main as kvexp, snapshot, with_tiny, FIXTURES

from kvexp.app.cli import SUBCOMMANDS as COMMANDS, main

from kvexp.app.compose import check, compose, compose_all, kv_choices
from kvexp.core.config import ConfigError
from kvexp.metrics.levels import Level, figure_warnings
from kvexp.results.store import load_document

import fake_openai  # noqa: E402

HEADLINE = ["backend=vllm,llamacpp", "kv=fp16,fp8"]
FOREIGN = FIXTURES / "foreign"
FAST = ["scenario.requests=2", "scenario.concurrency=[1]"]


@pytest.fixture(scope="module")
def fake(tmp_path_factory) -> Path:
    return fake_openai.wrapper(tmp_path_factory.mktemp("fake"))


@pytest.fixture(autouse=True)
def _own_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv("KVEXP_CALIBRATION", str(tmp_path / "calibration.json"))


# ---------------------------------------------------------------- 1. a sweep skips what cannot run
def test_the_headline_sweep_skips_only_llamacpp_fp8_by_default():
    kvs = kv_choices()
    jobs = compose_all([*TINY, *HEADLINE])
    reasons = {(c.backend.name, c.kv.name): check(c, kvs, multirun=True) for _, c in jobs}
    assert {k for k, r in reasons.items() if r is None} == {("vllm", "fp16"), ("vllm", "fp8"), ("llamacpp", "fp16")}
    assert reasons[("llamacpp", "fp8")].startswith("kv=fp8 is not available on backend=llamacpp")
    assert all(c.unsupported == "auto" for _, c in jobs)


def test_a_single_impossible_run_and_unsupported_error_still_refuse():
    kvs = kv_choices()
    with pytest.raises(ConfigError, match=r"^kv=fp8 is not available on backend=llamacpp"):
        check(compose([*TINY, "kv=fp8"]), kvs)  # no -m: one job, refused
    with pytest.raises(ConfigError, match=r"^kv=fp8 is not available"):
        check(compose([*TINY, "kv=fp8", "unsupported=error"]), kvs, multirun=True)
    assert check(compose([*TINY, "kv=fp8", "unsupported=skip"]), kvs) is not None


def test_a_sweep_says_what_it_skips_before_the_first_job(fake, tmp_path):
    folder = tmp_path / "s"
    p = subprocess.run([sys.executable, "-m", "kvexp", *with_tiny(["-m", f"backend.binary={fake}", "kv=fp16,fp8", *FAST,
                                                                   f"hydra.sweep.dir={folder}"])],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:]
    lines = p.stdout.splitlines()  # as a terminal shows them: standard output and error in their order
    assert lines[0] == ("kvexp: 1 of 2 jobs cannot run and are recorded as skipped (unsupported=error refuses them "
                        "instead):")
    assert lines[1] == ("kvexp:   skipped llamacpp-tiny-fp8-smoke: kv=fp8 is not available on backend=llamacpp "
                        "(allowed for llamacpp: bf16, fp16, iq4_nl, q4_0, q4_1, q5_0, q5_1, q8_0)")
    assert any("llamacpp-tiny-fp16-smoke: starting" in line for line in lines[2:])
    docs = [load_document(p)[1] for p in sorted(folder.glob("*/result.json"))]
    assert [(d["label"], d["status"]) for d in docs] == [("llamacpp-tiny-fp16-smoke", "complete"),
                                                         ("llamacpp-tiny-fp8-smoke", "skipped")]


@pytest.mark.parametrize("args", [["kv=fp8"], ["-m", "kv=fp16,fp8", "unsupported=error"]], ids=["single", "error"])
def test_refused_with_one_line_and_nothing_written(fake, tmp_path, capsys, monkeypatch, args):
    monkeypatch.chdir(tmp_path)
    assert kvexp(*args, f"backend.binary={fake}") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvexp: kv=fp8 is not available on backend=llamacpp (allowed for llamacpp: bf16, fp16, iq4_nl, q4_0, q4_1, q5_0, q5_1, q8_0)"]
    assert not (tmp_path / "outputs").exists()


# ---------------------------------------------------------------- 1b. keys of some backends only
def test_a_key_of_one_backend_applies_to_its_jobs_only():
    jobs = compose_all([*TINY, *HEADLINE, "backend.python=/opt/vllm/bin/python"])
    for _, cfg in jobs:
        if cfg.backend.name == "vllm":
            assert cfg.backend.python == "/opt/vllm/bin/python"
        else:
            assert "python" not in vars(cfg.backend)
    kvs = kv_choices()
    llama16 = next(c for _, c in jobs if (c.backend.name, c.kv.name) == ("llamacpp", "fp16"))
    assert check(llama16, kvs, multirun=True) is None  # no unknown-key refusal


@pytest.mark.parametrize("overrides,expected", [
    ([*HEADLINE, "backend.pyhton=/x"], "backend.pyhton: unknown key; allowed keys are"),
    (["backend=llamacpp", "backend.python=/x"], "backend.python: unknown key; allowed keys are"),
    (["backend=vllm,ollama", "backend.kv_rotation=off"], "backend.kv_rotation: unknown key; allowed keys are"),
])
def test_a_key_no_backend_of_the_sweep_declares_is_refused(overrides, expected):
    with pytest.raises(ConfigError) as e:
        for _, cfg in compose_all([*TINY, *overrides]):
            check(cfg, kv_choices(), multirun=True)
    assert "\n" not in str(e.value) and str(e.value).startswith(expected), str(e.value)


def test_a_mixed_sweep_runs_with_backend_only_keys(fake, tmp_path, capsys):
    """vLLM with q8_0 is skipped (no vLLM needed); the llama.cpp job gets backend.binary and ignores
    backend.python, and the terminal says both once, before the first job."""
    folder = tmp_path / "s"
    assert kvexp("-m", "backend=vllm,llamacpp", "kv=q8_0", f"backend.binary={fake}", "backend.python=/nowhere/python",
                 *FAST, f"hydra.sweep.dir={folder}") == 0
    err = capsys.readouterr().err
    assert err.count("kvexp: backend.python is a key of backend=vllm only: ignored for the llamacpp jobs") == 1
    assert err.count("kvexp: backend.binary is a key of backend=llamacpp only: ignored for the vllm jobs") == 1
    docs = [load_document(p)[1] for p in sorted(folder.glob("*/result.json"))]
    assert [(d["label"], d["status"]) for d in docs] == [("vllm-tiny-q8_0-smoke", "skipped"),
                                                         ("llamacpp-tiny-q8_0-smoke", "complete")]
    assert "python" not in docs[1]["config"]["backend"] and docs[1]["config"]["backend"]["binary"] == str(fake)

    # 2. resume of the finished sweep: nothing to do, one line, nothing touched
    before = snapshot(folder)
    assert kvexp("resume", str(folder)) == 0
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == [f"kvexp: nothing to resume in {folder}: its 2 jobs are finished "
                                        "(1 complete, 1 skipped)"]
    assert "starting" not in out + err and snapshot(folder) == before


# ---------------------------------------------------------------- 2. resume
def test_jobs_that_share_a_label_are_each_counted(fake, tmp_path, capsys):
    """A sweep over backend.threads: two jobs, one label. A second run into its folder counts both results
    (it said 1), and a resume finds both finished."""
    folder = tmp_path / "s"
    args = ["-m", f"backend.binary={fake}", "backend.threads=1,2", *FAST, f"hydra.sweep.dir={folder}"]
    assert kvexp(*args) == 0
    capsys.readouterr()
    assert kvexp(*args) == 1
    assert capsys.readouterr().err.startswith(f"kvexp: {folder}: already holds 2 result(s)")
    assert kvexp("resume", str(folder)) == 0
    assert capsys.readouterr().err.strip() == (f"kvexp: nothing to resume in {folder}: its 2 jobs are finished "
                                               "(2 complete)")


def test_resume_measures_what_is_missing_and_then_has_nothing_to_do(fake, tmp_path, capsys):
    folder = tmp_path / "s"
    assert kvexp("-m", f"backend.binary={fake}", "kv=fp16,q8_0", *FAST, f"hydra.sweep.dir={folder}") == 0
    done = next(folder.glob("1_*"))
    shutil.rmtree(done)
    capsys.readouterr()
    assert kvexp("resume", str(folder)) == 0
    assert "kvexp: resuming: " in capsys.readouterr().err
    assert (done / "result.json").is_file()
    assert kvexp("resume", str(folder)) == 0
    assert capsys.readouterr().err.startswith(f"kvexp: nothing to resume in {folder}: its 2 jobs are finished")


def test_resume_of_a_finished_single_run(fake, tmp_path, capsys):
    run = tmp_path / "run"
    assert kvexp(f"backend.binary={fake}", *FAST, f"hydra.run.dir={run}") == 0
    capsys.readouterr()
    before = snapshot(run)
    assert kvexp("resume", str(run)) == 0
    assert capsys.readouterr().err.strip() == f"kvexp: nothing to resume in {run}: its job is finished (1 complete)"
    assert snapshot(run) == before

    # a report cut short (Ctrl-C while it renders): the resume renders it, and measures nothing
    (run / "report" / "comparison.csv").unlink()
    assert kvexp("resume", str(run)) == 0
    out, err = capsys.readouterr()
    assert err.strip().splitlines()[0] == f"kvexp: nothing to resume in {run}: its job is finished (1 complete)"
    assert re.fullmatch(rf"kvexp: its report was missing or older than its results; wrote \d+ files in "
                        rf"{re.escape(str(run / 'report'))}", err.strip().splitlines()[1]), err
    assert len(err.strip().splitlines()) == 2 and "starting" not in out + err
    assert (run / "report" / "comparison.csv").is_file()
    assert {p: v for p, v in snapshot(run).items() if "report" not in str(p)} == \
        {p: v for p, v in before.items() if "report" not in str(p)}


# ---------------------------------------------------------------- 3. validate takes folders
def test_validate_a_folder_checks_every_result_under_it(fake, tmp_path, capsys):
    folder = tmp_path / "s"
    assert kvexp("-m", f"backend.binary={fake}", "kv=fp16,fp8", *FAST, f"hydra.sweep.dir={folder}") == 0
    capsys.readouterr()
    assert main(["validate", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    results = sorted(folder.glob("*/result.json"))
    assert out == [f"{p}: valid" for p in results]

    bad = json.loads(results[0].read_text())
    del bad["label"]
    bad["status"] = "done"
    results[0].write_text(json.dumps(bad))
    assert main(["validate", str(folder)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0].startswith(f"{results[0]}: ") and "(and 1 more: kvexp validate" in out[0]
    assert out[1] == f"{results[1]}: valid"

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["validate", str(empty)]) == 1
    assert capsys.readouterr().out.strip() == f"{empty}: no result.json found in this folder"


# ---------------------------------------------------------------- 4. --help lists every command
def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for cmd in COMMANDS:
        assert f"\n  {cmd} " in out or f"\n  {cmd}\n" in out, cmd
    assert set(COMMANDS) <= set(SUBCOMMANDS)
    assert "unsupported=auto|error|skip" in out


# ---------------------------------------------------------------- 5. results: a table, CSV on request
def test_results_prints_an_aligned_table(fake, tmp_path, capsys):
    folder = tmp_path / "s"
    assert kvexp("-m", f"backend.binary={fake}", "kv=fp16,fp8", "scenario.requests=2",
                 "scenario.concurrency=[1,2]", f"hydra.sweep.dir={folder}") == 0
    capsys.readouterr()
    assert main(["results", str(folder)]) == 0
    lines = capsys.readouterr().out.rstrip("\n").splitlines()
    head, rule, *rows, foot = lines
    for word in ("job", "backend", "kv", "Concurrency", "tok/s", "TTFT p50", "TPOT p50", "Peak KV"):
        assert word in head
    assert set(rule.replace(" ", "")) == {"-"}
    assert len(rows) == 3 and foot.startswith("3 row(s) from 2 run(s)")
    text = "\n".join(rows)
    assert "None" not in text and "nan" not in text.lower()
    skipped = next(r for r in rows if "fp8" in r)
    assert "skipped" in skipped and "—" in skipped
    starts = [rule.index("-", i) for i in range(len(rule)) if rule[i] == "-" and (i == 0 or rule[i - 1] == " ")]
    for row in rows:  # every column starts where its rule starts: text left, numbers right-aligned
        assert len(row) <= len(rule)
        for s in starts[1:]:
            assert row[s - 1] == " " or row[s - 2:s] == "  ", (row, s)

    assert main(["results", str(folder), "--csv"]) == 0
    assert capsys.readouterr().out.startswith("label,backend,model,scenario,kv_dtype,")
    out = tmp_path / "levels.csv"
    assert main(["results", str(folder), "--csv", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"csv: {out}"
    assert out.read_text().startswith("label,backend,")
    assert main(["results", str(folder), "--csv", str(out)]) == 0  # its own CSV again: replaced
    assert capsys.readouterr().out.strip() == f"csv: {out}"
    # a label a spreadsheet would run as a formula is written as text
    job = next(folder.glob("*/result.json"))
    doc = json.loads(job.read_text())
    doc["label"] = '=HYPERLINK("http://example.invalid","x")'
    job.write_text(json.dumps(doc))
    assert main(["results", str(job), "--csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert rows and all(row["label"] == "'" + doc["label"] for row in rows)
    # --csv OUT naming a result file, a request log or a folder: refused in one line, the file kept
    log = next(folder.rglob("requests.jsonl"))
    result = log.with_name("result.json")
    before = {f: f.read_bytes() for f in (result, log)}
    for dest, what in ((result, "is not a .csv file"), (log, "is not a .csv file"), (result.parent, "a folder"),
                       ("", "a folder")):
        assert main(["results", str(folder), "--csv", str(dest)]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and what in err[0], err
    assert {f: f.read_bytes() for f in before} == before
    # the same run named twice (in its folder and as its file) is one run, not a tie with itself
    assert main(["results", str(folder)]) == 0
    once = capsys.readouterr().out
    assert main(["results", str(folder), str(result)]) == 0
    assert capsys.readouterr().out == once
    # a report title that would clear the terminal or break a heading: refused before anything is written
    assert main(["report", str(folder), "--title", "T\x1b[2J\nX", "--out", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'\\x1b' at position 1" in err[0], err
    assert not (tmp_path / "r").exists()


def test_results_of_other_tools_files_never_print_none_or_nan(capsys):
    assert main(["results", str(FOREIGN)]) == 0
    out = capsys.readouterr().out
    assert "None" not in out and "nan" not in out.lower() and "—" in out


def test_results_frame_missing_values_are_nan():
    pd = pytest.importorskip("pandas")
    import kvexp

    df = kvexp.results_frame([FOREIGN])
    assert not any(v is None for v in df.to_numpy().ravel())
    itl = df[df["tool"] == "GuideLLM 0.8.1"]["itl_p50_ms"]
    assert itl.isna().all() and all(isinstance(v, float) and math.isnan(v) for v in itl)
    assert pd.api.types.is_float_dtype(df["ttft_p50_ms"])


# ---------------------------------------------------------------- 6. the client-workers advice
def _limited(cpu):
    level = Level.from_json({"requests": 64, "errors": 0, "loop_lag_p99_ms": 40.0, "client_cpu_util": cpu,
                             "client_limited": True})
    [w] = [w for w in figure_warnings(level, ["client event loop lagged 40 ms (p99, limit 5 ms)"])
           if w.code == "client_limited"]
    return w.text


def test_client_advice_names_the_likely_cause():
    busy = _limited(0.95)
    assert "set client.workers" in busy
    loaded = _limited(0.08)
    assert "set client.workers" not in loaded and "client.workers" not in loaded
    assert "8 %" in loaded and "machine was loaded" in loaded and "server shares the cores" in loaded
    assert "client.workers" in _limited(None)  # not recorded: both causes named


def test_a_path_the_system_refuses_is_one_line(tmp_path, capsys):
    """A folder name over 255 bytes makes the OS refuse the path itself (ENAMETOOLONG, even to ask whether
    it is a folder): every command says so in one line naming it, not a traceback."""
    long = tmp_path / ("x" * 300)
    for argv in (["validate", str(long / "result.json")], ["results", str(long)], ["resume", str(long)],
                 ["report", str(long), "--out", str(tmp_path / "r")]):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"kvexp: {long}") and "File name too long" in err[0], (argv, err)


# ---------------------------------------------------------------- Hydra's flags, anywhere on the line
@pytest.mark.parametrize("args, line", [
    (["--bogus-flag"], "--bogus-flag: not an option of a run (options: -m, --cfg job|hydra|all"),
    (["--cfg=jobs"], "--cfg jobs: allowed values are job, hydra, all"),
    (["--cfg"], "--cfg: needs a value (job, hydra, all)"),
    (["--config-name", "other"], "--config-name: kvexp composes its own configuration"),
    (["-m", "kv=fp16,q8_0", "--cfg=job"], "-m and --cfg: a run takes one of -m, --run, --cfg"),
    (["--hydra-help"], "--hydra-help: not an option of a run"),
    (["-"], "'-': not an override (key=value) or an option"),
    (["=5"], "'=5': not an override (key=value) or an option"),
    # where a job writes: kvexp's to decide (one job overwrote another's result with a shared subdir)
    (["-m", "kv=fp16,q8_0", "hydra.sweep.subdir=same"], "hydra.sweep.subdir=same: kvexp names each job's folder"),
    (["hydra.output_subdir=null"], "hydra.output_subdir=null: a resume reads what Hydra saves there"),
    (["output_dir=/tmp/elsewhere"], "output_dir=/tmp/elsewhere: kvexp sets it to the job's folder"),
    (["-m", "kv=fp16,fp16"], "kv=fp16,fp16: fp16 is given twice; each value is one job"),
])
def test_a_flag_hydra_would_refuse_is_one_line_and_makes_no_folder(tmp_path, capsys, args, line):
    """Hydra's own answer was its usage text and exit status 2 (after an empty run folder was made), or a
    traceback for -m with --cfg."""
    assert kvexp(*args, f"hydra.run.dir={tmp_path}/run", f"hydra.sweep.dir={tmp_path}/sweep") == 1
    err = capsys.readouterr().err
    assert err.startswith(f"kvexp: {line}") and err.count("\n") == 1, err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("args, line", [
    (["-m", "kv=fp16,q8_0", "hydra.run.dir=X"], "hydra.run.dir=X: a sweep (-m) writes into hydra.sweep.dir"),
    (["hydra.sweep.dir=X"], "hydra.sweep.dir=X: a single run writes into hydra.run.dir"),
    (["hydra.run.dir=''"], "hydra.run.dir='': give a folder"),
])
def test_a_folder_setting_that_would_be_ignored_is_refused(tmp_path, capsys, args, line):
    """The only folder given was one the mode does not write into: the results went to outputs/."""
    assert kvexp(*args) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"kvexp: {line}") and err.count("\n") == 1, err


def test_info_without_a_value_leaves_the_next_override_alone(tmp_path):
    # (a process of its own: Hydra's --info sets up logging on the streams of the moment)
    p = subprocess.run([sys.executable, "-m", "kvexp", *TINY, "--info", "scenario.requests=3"], capture_output=True,
                       text=True, cwd=tmp_path, timeout=300)
    assert p.returncode == 0 and "Config search path" in p.stdout, p.stderr[-2000:]


def test_cfg_job_with_a_space_prints_the_config(tmp_path, capsys):
    """`--cfg job` as --help shows it (the value used to be taken for an override named `job`), after the
    overrides too."""
    assert kvexp("scenario.requests=3", "--cfg", "job", f"hydra.run.dir={tmp_path}/run") == 0
    out = capsys.readouterr().out
    assert "backend:" in out and "requests: 3" in out
    assert not (tmp_path / "run").exists()


def test_validate_writes_a_file_name_that_would_drive_the_terminal_escaped(tmp_path, capsys):
    folder = tmp_path / "a\x1b[2Jb"
    folder.mkdir()
    (folder / "result.json").write_text("{}")
    assert main(["validate", str(folder)]) == 1
    out = capsys.readouterr().out
    assert "\x1b" not in out and "a\\x1b[2Jb" in out and out.count("\n") == 1, out


def test_a_file_named_twice_is_validated_once_and_a_loop_of_links_is_named(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    result = tmp_path / "run" / "result.json"
    result.write_text("{}")
    assert main(["validate", str(result), str(tmp_path / "run")]) == 1
    assert capsys.readouterr().out.count("\n") == 1  # one file: its line, once
    loop = tmp_path / "loop.json"
    loop.symlink_to(tmp_path / "other.json")
    (tmp_path / "other.json").symlink_to(loop)
    assert main(["results", str(loop)]) == 1
    assert capsys.readouterr().err == f"kvexp: {loop}: cannot read: Too many levels of symbolic links\n"


def test_a_loop_of_links_inside_a_folder_is_named_not_missed(tmp_path, capsys):
    """A result.json that is a link to nowhere or a loop of links, inside a folder given: named with why it
    cannot be read (it was "no result.json found in this folder")."""
    (tmp_path / "run").mkdir()
    loop = tmp_path / "run" / "result.json"
    loop.symlink_to(loop)
    for command in ("results", "report"):
        assert main([command, str(tmp_path), *(["--out", str(tmp_path / "out")] if command == "report" else [])]) == 1
        assert capsys.readouterr().err == f"kvexp: {loop}: cannot read: Too many levels of symbolic links\n"
    assert main(["validate", str(tmp_path)]) == 1
    assert capsys.readouterr().out == f"{loop}: cannot read: Too many levels of symbolic links\n"


def test_version_and_plan_refuse_what_they_would_ignore(capsys):
    assert main(["--version", "extra"]) == 1
    assert capsys.readouterr().err == "kvexp: --version takes no other argument (given: --version extra)\n"
    assert main(["plan", *TINY, "--cfg", "job"]) == 1
    assert capsys.readouterr().err == ("kvexp: plan: --cfg: not a flag plan takes; allowed: overrides (group=option, "
                                       "group.key=value), --gpus and -m\n")


def test_a_report_title_longer_than_a_page_heading_is_refused(tmp_path, capsys):
    assert main(["report", str(tmp_path), "--title", "x" * 201, "--out", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err == "kvexp: report --title: 201 characters; allowed at most 200\n"
    assert not (tmp_path / "out").exists()


def _kvexp_into(stdout: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """kvexp as its own process with its standard output a pipe no one reads any more ("pipe"), /dev/full
    ("full"), or closed ("closed")."""
    cmd = [sys.executable, "-m", "kvexp", *args]
    if stdout == "closed":
        return subprocess.run(["bash", "-c", 'exec "$@" >&-', "bash", *cmd], cwd=cwd, capture_output=True, text=True)
    if stdout == "full":
        with open("/dev/full", "w") as full:
            return subprocess.run(cmd, cwd=cwd, stdout=full, stderr=subprocess.PIPE, text=True)
    read, write = os.pipe()
    os.close(read)  # the reader has left: `| head -1` after its line
    try:
        return subprocess.run(cmd, cwd=cwd, stdout=write, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write)


def test_a_standard_output_that_goes_away_is_one_line_and_the_run_still_saves(fake, tmp_path):
    """A closed pipe (`| head -1`), a full device, a closed descriptor: each used to end in a traceback (a
    run printed 15 "--- Logging error ---" blocks and called its written report unrendered). A run goes on
    and saves what it measures; the exit status says output was lost: 141 quietly for a pipe whose reader
    left (as a shell reports a program SIGPIPE ended), else 1 and one line."""
    run = _kvexp_into("pipe", [*with_tiny([f"backend.binary={fake}", *FAST]), f"hydra.run.dir={tmp_path}/run"],
                      tmp_path)
    assert (run.returncode, run.stderr) == (141, "")
    assert load_document(tmp_path / "run" / "result.json")[1]["status"] == "complete"
    assert (tmp_path / "run" / "report").is_dir()
    lines = {"full": "kvexp: could not write to standard output: No space left on device\n",
             "closed": "kvexp: standard output is closed (discard it with >/dev/null instead)\n"}
    for args in (["validate", "run"], ["results", "run"], ["results", "--csv", "-", "run"], ["plan", *TINY],
                 ["--help"], ["--version"]):
        p = _kvexp_into("pipe", args, tmp_path)
        assert (p.returncode, p.stderr) == (141, ""), args
        for stdout, line in lines.items():
            p = _kvexp_into(stdout, args, tmp_path)
            assert (p.returncode, p.stderr) == (1, line), (args, stdout)
