"""Inputs kvexp used to accept, or refused with a traceback or the wrong words, each now one line with
exit status 1, on real files: a Python without vLLM as backend.python, a warm-up of a million requests,
a dataset of empty user turns, a GuideLLM file of no benchmark, a request log given where a result
belongs, a KVEXP_CACHE that is a file, and a run folder whose request log was deleted or cut (resume
refuses it, validate calls it invalid)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY, kvexp_main, snapshot, FIXTURES, ROOT

import fake_openai  # noqa: E402

GUIDELLM = FIXTURES / "foreign" / "guidellm" / "benchmarks.json"


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def kvexp(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-m", "kvexp", *args], cwd=cwd, env=full, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("python, why", [
    ("/bin/false", "is not a Python that runs (status 1)"),
    (sys.executable, "has no vLLM (its `import vllm` would fail)"),  # the tests' own Python: no vLLM in it
    ("/nowhere/python", "cannot be run (No such file or directory)"),
])
def test_a_python_without_vllm_is_refused_before_anything_runs(tmp_path, capsys, python, why):
    assert kvexp_main("backend=vllm", f"backend.python={python}", f"hydra.run.dir={tmp_path}/run") == 1
    assert one_line(capsys) == (f"kvexp: backend.python={python}: {why}; give the Python of an environment with "
                                "vLLM installed, or leave it unset for kvexp's own (`python -m kvexp install vllm`)")
    assert not (tmp_path / "run").exists()


def test_a_warmup_beyond_its_bound_is_refused(tmp_path, capsys):
    assert kvexp_main("scenario.warmup_requests=1000000", f"hydra.run.dir={tmp_path}/run") == 1
    assert one_line(capsys) == ("kvexp: scenario.warmup_requests=1000000: must be >= 0 and <= 1,000 (a warm-up only "
                                "wakes the server and is not measured; measure more with scenario.requests)")


@pytest.mark.parametrize("line, field", [
    ({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": ""}]}, "messages[1].content"),
    ({"conversations": [{"from": "human", "value": "  \n"}]}, "conversations[0].value"),
    ({"prompt": ""}, "prompt"),
])
def test_a_dataset_of_empty_prompts_is_refused(tmp_path, capsys, line, field):
    data = tmp_path / "empty.jsonl"
    data.write_text(json.dumps(line) + "\n" + json.dumps(line) + "\n")
    assert kvexp_main("scenario=sharegpt", f"scenario.dataset={data}", f"hydra.run.dir={tmp_path}/run") == 1
    assert one_line(capsys) == (f"kvexp: scenario.dataset: {data} line 1: {field}: an empty user message: its request "
                                "would send the chat template alone")


def test_a_guidellm_file_of_no_benchmark_is_refused(tmp_path, capsys):
    doc = json.loads(GUIDELLM.read_text())
    doc["benchmarks"] = []
    f = tmp_path / "benchmarks.json"
    f.write_text(json.dumps(doc))
    why = "GuideLLM file with no benchmark ($.benchmarks is empty): it measured nothing to report"
    for command in (["report", str(f), "--out", str(tmp_path / "report")], ["results", str(f)]):
        assert kvexp_main(*command) == 1
        assert one_line(capsys) == f"kvexp: {f}: {why}"
    assert not (tmp_path / "report").exists()
    assert kvexp_main("validate", str(f)) == 1
    assert capsys.readouterr().out == f"{f}: {why}\n"


@pytest.fixture
def run_folder(tmp_path) -> Path:
    """A run of two levels on the fake llama-server, as `python -m kvexp` writes it, then stopped after
    its first level (its result says partial and holds level 1)."""
    fake = fake_openai.wrapper(tmp_path)
    run = tmp_path / "run"
    assert kvexp_main(f"backend.binary={fake}", "scenario.concurrency=[1,2]", "scenario.requests=4",
                      f"hydra.run.dir={run}") == 0
    doc = json.loads((run / "result.json").read_text())
    doc.update(status="partial", status_reason="interrupted by SIGINT after 1 level(s)", levels=doc["levels"][:1])
    (run / "result.json").write_text(json.dumps(doc))
    return run


def test_a_request_log_is_named_as_such(run_folder, capsys):
    log = run_folder / "requests.jsonl"
    want = (f"kvexp: {log}: a request log (requests.jsonl, one request per line), not a result: give its run "
            f"folder ({run_folder}) or its result.json")
    assert kvexp_main("results", str(log)) == 1
    assert one_line(capsys) == want
    assert kvexp_main("report", str(log), "--out", str(run_folder.parent / "report")) == 1
    assert one_line(capsys) == want


@pytest.mark.parametrize("cut", ["deleted", "shorter"])
def test_resume_refuses_a_run_whose_request_log_lacks_its_levels(run_folder, capsys, cut):
    log = run_folder / "requests.jsonl"
    if cut == "deleted":
        log.unlink()
        why = (f"{log}: missing: the request log of the 1 level(s) in {run_folder / 'result.json'} (their requests "
               "cannot be read or resumed)")
    else:
        rows = [x for x in log.read_text().splitlines() if not json.loads(x)["warmup"]]
        log.write_text("\n".join(rows[:3]) + "\n")  # level 1 measured 4
        why = (f"{log}: 3 request line(s) for concurrency 1, whose level in {run_folder / 'result.json'} counts 4: "
               "the log was cut or edited")
    before = snapshot(run_folder)
    assert kvexp_main("validate", str(run_folder)) == 1
    assert capsys.readouterr().out == f"{why}\n"
    assert kvexp_main("resume", str(run_folder)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"kvexp: resume refused: {why}; nothing in the folder was changed. To measure it "
                              "again, start a new run: python -m kvexp "), err
    assert len(err) == 2 and err[0].startswith("kvexp: resuming: ")
    assert snapshot(run_folder) == before


def test_a_cache_that_is_a_file_is_named_as_such(tmp_path):
    cache = tmp_path / "cache"
    cache.write_text("")
    want = f"kvexp: {cache}: KVEXP_CACHE names a file, not a folder: name a folder (or unset it)\n"
    for args in ([*TINY, f"hydra.run.dir={tmp_path}/run"], ["plan", *TINY], ["install", "llamacpp"], ["cleanup"]):
        p = kvexp(args, tmp_path, KVEXP_CACHE=str(cache))
        assert (p.returncode, p.stderr) == (1, want), args
    assert not (tmp_path / "run").exists()


BLOCK = """\
import sys


class _Absent:  # the `cluster` extra not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "submitit" or name.startswith("hydra_plugins.hydra_submitit_launcher"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _Absent())
"""


@pytest.mark.parametrize("launcher", ["submitit_slurm", "kvexp_slurm", "submitit_local"])
def test_a_cluster_launcher_without_the_cluster_extra_is_one_line(tmp_path, launcher):
    """It was Hydra's 25-line "Unknown plugin class" traceback."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCK)
    p = kvexp(["-m", f"hydra/launcher={launcher}", *TINY, "kv=fp16,q8_0", f"hydra.sweep.dir={tmp_path}/sweep"],
              tmp_path, PYTHONPATH=f"{tmp_path / 'site'}{os.pathsep}{ROOT}")
    assert (p.returncode, p.stderr) == (1, f"kvexp: hydra/launcher={launcher}: needs kvexp's cluster extra "
                                           "(hydra-submitit-launcher, submitit): pip install 'kvexp[cluster]'\n")
    assert not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("launcher", ["submitit_slurm", "kvexp_slurm"])
def test_a_slurm_launcher_where_slurm_is_not_is_one_line(tmp_path, launcher):
    """No sbatch or srun on PATH (a laptop, a node without Slurm's client): it was submitit's traceback."""
    bare = tmp_path / "bin"
    bare.mkdir()
    p = kvexp(["-m", f"hydra/launcher={launcher}", *TINY, "kv=fp16,q8_0", f"hydra.sweep.dir={tmp_path}/sweep"],
              tmp_path, PATH=str(bare))
    assert (p.returncode, p.stderr) == (1, f"kvexp: hydra/launcher={launcher}: sbatch and srun not found on PATH: "
                                           "submit from a machine of a Slurm cluster (a login node), or run the "
                                           "jobs here with hydra/launcher=submitit_local\n")
    assert not (tmp_path / "sweep").exists()
