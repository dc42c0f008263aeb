"""Sweeps through Slurm on a real one-node cluster on loopback (Debian's slurm-wlm, slurmdbd, munge and
mariadb-server; tests/support/slurm_cluster.py starts and stops it) with the real llama-server and the tiny model:
two jobs through `hydra/launcher=submitit_slurm` that complete, each result recording its Slurm job id and
node, and the sweep's report; then a sweep through `hydra/launcher=kvexp_slurm` with one job cancelled with
scancel while it measures: the sweep says so in one line, is still reported and fails, no server of that
job is left, and the other job's result is whole; `kvexp resume` then submits and runs only the cancelled
job again. A job cancelled while still pending gets a failed result, fails the sweep, and is run by resume."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import slurm_cluster
from conftest import missing, with_tiny

from kvexp.results.validate import check_file

pytestmark = pytest.mark.slurm

# what one small node grants a job: no GPU (no gres), one CPU, 1 GB, ten minutes
RESOURCES = [f"hydra.launcher.partition={slurm_cluster.PARTITION}", "hydra.launcher.gpus_per_node=null",
             "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1", "hydra.launcher.timeout_min=10"]
NOTICE = "is validated against ConfigStore schema"  # Hydra's schema-matching deprecation notice
# a scenario that measures long enough to be cancelled while it does, whatever the machine's speed: one
# open-loop level of 48 requests at 4 per second (12 s), from a test config folder
SLOW = """\
defaults:
  - scenario_schema
  - _self_
name: slow
prompt_tokens: 32
max_tokens: 16
rates: [4]
requests: 48
warmup_requests: 1
"""
SLOW_LABEL = "llamacpp-tiny-fp16-slow"
WAIT_S = 180  # a sweep of the tiny model; the limit only stops a hung test


@pytest.fixture(scope="module")
def cluster():
    gone = slurm_cluster.missing()
    if gone or os.geteuid() != 0:
        why = (f"{', '.join(gone)} missing (apt-get install {slurm_cluster.PACKAGES})" if gone
               else "the one-node Slurm cluster runs its daemons as root")
        missing(f"the Slurm test cluster ({why})", "install them")
    with slurm_cluster.SlurmCluster() as c:
        yield c


def kvexp(cluster, args: list[str], cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "SLURM_CONF": str(cluster.conf)}
    return subprocess.Popen([sys.executable, "-m", "kvexp", *with_tiny(args)], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def sweep_dir(cwd: Path) -> Path:
    (d,) = (cwd / "outputs" / "sweeps").iterdir()
    return d


def finish(p: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = p.communicate(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"the sweep did not end:\n{err[-3000:]}")
    return p.returncode, out, err


def result(d: Path) -> dict:
    assert check_file(d / "result.json") == [], d
    return json.loads((d / "result.json").read_text())


# ---------------------------------------------------------------- two jobs that complete
@pytest.fixture(scope="module")
def sweep(cluster, llama_server, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("slurm_sweep")
    p = kvexp(cluster, ["-m", "kv=fp16,q8_0", f"backend.binary={llama_server}", "hydra/launcher=submitit_slurm",
                        *RESOURCES], cwd)
    rc, out, err = finish(p)
    assert rc == 0, err[-3000:]
    return sweep_dir(cwd), out, err


@pytest.mark.timeout(400)
def test_a_sweep_runs_as_slurm_jobs_and_each_result_records_its_job_id(cluster, sweep):
    d, out, err = sweep
    jobs = sorted(d.glob("*/result.json"))
    assert [p.parent.name for p in jobs] == ["0_llamacpp-tiny-fp16-smoke", "1_llamacpp-tiny-q8_0-smoke"]
    scheds = []
    for path in jobs:
        res = result(path.parent)
        assert res["status"] == "complete"
        scheds.append(res["environment"]["scheduler"])
    assert all(s["kind"] == "slurm" and s["node"] == slurm_cluster.NODE for s in scheds), scheds
    assert sorted(s["array_task_id"] for s in scheds) == [0, 1]  # submitit submits a sweep as one job array
    (array,) = {s["array_job_id"] for s in scheds}
    assert len({s["job_id"] for s in scheds}) == 2
    # Slurm's own accounting knows both, by the ids the results recorded, as completed
    assert cluster.accounting(array) == {(f"{array}_{s['array_task_id']}", s["job_id"], "COMPLETED") for s in scheds}


@pytest.mark.timeout(400)
def test_the_slurm_sweep_is_gathered_into_its_report(sweep):
    d, out, err = sweep
    assert check_file(d / "sweep.json") == []
    agg = json.loads((d / "sweep.json").read_text())
    assert [(r["label"], r["status"]) for r in agg["runs"]] == [
        ("llamacpp-tiny-fp16-smoke", "complete"), ("llamacpp-tiny-q8_0-smoke", "complete")]
    assert agg["environment"]["scheduler"]["kind"] == "slurm"
    assert "| llamacpp-tiny-q8_0-smoke |" in (d / "summary.md").read_text()
    assert (d / "report" / "report.html").is_file() and (d / "report" / "report.md").is_file()
    assert "sweep: 2 job(s): 2 server start(s)" in out + err


@pytest.mark.timeout(400)
def test_the_slurm_sweep_prints_no_deprecation_notice(sweep):
    d, out, err = sweep
    assert NOTICE not in out + err


# ---------------------------------------------------------------- one job cancelled while it measures
def slow_sweep(cluster, llama_server, cwd: Path, scenarios: str, *extra: str) -> tuple[subprocess.Popen, dict]:
    """A sweep through `hydra/launcher=kvexp_slurm` with the slow scenario (from a test config folder),
    once its slow job measures on its own server: the sweep's process and that job's scheduler record."""
    conf = cwd / "conf"
    (conf / "scenario").mkdir(parents=True)
    (conf / "scenario" / "slow.yaml").write_text(SLOW)
    p = kvexp(cluster, ["-m", f"scenario={scenarios}", f"hydra.searchpath=[file://{conf}]",
                        f"backend.binary={llama_server}", "hydra/launcher=kvexp_slurm", *RESOURCES, *extra], cwd)
    end = time.monotonic() + WAIT_S
    with killed_on_failure(p):
        while p.poll() is None and time.monotonic() < end:
            log = next(cwd.glob(f"outputs/sweeps/*/*_{SLOW_LABEL}/kvexp.log"), None)
            if log and f"{SLOW_LABEL}: level 4:" in log.read_text(errors="replace"):
                return p, json.loads((log.parent / "result.json").read_text())["environment"]["scheduler"]
            time.sleep(0.5)
        pytest.fail("the slow job never started measuring")


@contextlib.contextmanager
def killed_on_failure(p: subprocess.Popen):
    """The sweep is killed when the block fails (a test that fails leaves no sweep running)."""
    try:
        yield
    except BaseException:
        p.kill()
        p.communicate()
        raise


@pytest.fixture(scope="module")
def cancelled(cluster, llama_server, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("slurm_cancel")
    p, sched = slow_sweep(cluster, llama_server, cwd, "smoke,slow")
    with killed_on_failure(p):
        servers = [q for q in cluster.job_processes(sched["job_id"]) if q.name().startswith("llama-server")]
        job = f"{sched['array_job_id']}_{sched['array_task_id']}"
        assert cluster.jobs().get(job) == "RUNNING"
        cancel = cluster.run("scancel", job)
        assert cancel.returncode == 0, cancel.stderr
    rc, out, err = finish(p)
    return {"dir": sweep_dir(cwd), "rc": rc, "out": out, "err": err, "job": job, "sched": sched,
            "servers": servers, "cwd": cwd}


@pytest.mark.timeout(400)
def test_a_cancelled_job_leaves_no_server_and_the_other_result_whole(cluster, cancelled):
    assert cancelled["servers"], "the slow job's llama-server was not seen"
    alive = [s for s in cancelled["servers"] if s.is_running() and s.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"servers of the cancelled job still running: {alive}"
    assert not [q for q in cluster.job_processes(cancelled["sched"]["job_id"])]  # nothing of that job at all
    (row,) = [r for r in cluster.accounting(cancelled["job"]) if r[0] == cancelled["job"]]
    assert row[1] == cancelled["sched"]["job_id"] and row[2].startswith("CANCELLED"), row
    other = result(cancelled["dir"] / "0_llamacpp-tiny-fp16-smoke")
    assert other["status"] == "complete" and len(other["levels"]) == 2
    assert other["environment"]["scheduler"]["array_job_id"] == cancelled["sched"]["array_job_id"]
    assert check_file(cancelled["dir"] / "0_llamacpp-tiny-fp16-smoke" / "requests.jsonl") == []


@pytest.mark.timeout(400)
def test_a_cancelled_job_fails_the_sweep_with_one_line_naming_it(cancelled):
    text = cancelled["out"] + cancelled["err"]
    assert cancelled["rc"] == 1, text[-3000:]  # docs/cluster.md: a job that left no result fails the sweep
    assert "Traceback" not in text, text[-3000:]
    named = [ln for ln in text.splitlines() if SLOW_LABEL in ln and "cancel" in ln.lower()]
    assert named and cancelled["job"] in named[0], text[-3000:]
    assert NOTICE not in text
    d = cancelled["dir"]
    slow = result(d / f"1_{SLOW_LABEL}")  # the launcher recorded Slurm's verdict in the job's own result
    assert slow["status"] == "failed" and slow["status_reason"].startswith(f"cancelled (Slurm job {cancelled['job']}")
    statuses = {r["label"]: r["status"] for r in json.loads((d / "sweep.json").read_text())["runs"]}
    assert statuses == {"llamacpp-tiny-fp16-smoke": "complete", SLOW_LABEL: "failed"}
    assert (d / "summary.md").is_file() and (d / "report" / "report.html").is_file()


# ---------------------------------------------------------------- the cancelled sweep resumed
@pytest.fixture(scope="module")
def resumed(cluster, cancelled):
    d = cancelled["dir"]
    before = result(d / "0_llamacpp-tiny-fp16-smoke")
    rc, out, err = finish(kvexp(cluster, ["resume", str(d)], cancelled["cwd"]))
    return {"rc": rc, "out": out, "err": err, "before": before}


@pytest.mark.timeout(400)
def test_resume_runs_only_the_cancelled_job_again(cluster, cancelled, resumed):
    text = resumed["out"] + resumed["err"]
    assert resumed["rc"] == 0, text[-3000:]
    assert "hydra/launcher=kvexp_slurm" in text and NOTICE not in text
    d = cancelled["dir"]
    assert result(d / "0_llamacpp-tiny-fp16-smoke") == resumed["before"]  # kept as it was, not measured again
    slow = result(d / f"1_{SLOW_LABEL}")
    assert slow["status"] == "complete" and len(slow["levels"]) == 1 and slow["resumed_at"]
    sched = slow["environment"]["scheduler"]
    assert sched["job_id"] != cancelled["sched"]["job_id"] and sched["node"] == slurm_cluster.NODE
    assert check_file(d / f"1_{SLOW_LABEL}" / "requests.jsonl") == []
    statuses = {r["label"]: r["status"] for r in json.loads((d / "sweep.json").read_text())["runs"]}
    assert statuses == {"llamacpp-tiny-fp16-smoke": "complete", SLOW_LABEL: "complete"}
    # the complete job was not submitted again: the resume's job array holds the cancelled one only
    assert "(finished: kept, not submitted)" in text
    submitted = str(sched["array_job_id"] or sched["job_id"])  # one job submitted alone is no array
    assert len(cluster.accounting(submitted)) == 1, cluster.accounting(submitted)


# ---------------------------------------------------------------- one job cancelled before it started
@pytest.fixture(scope="module")
def pending(cluster, llama_server, tmp_path_factory):
    """A sweep of two jobs, one at a time (array_parallelism=1): the second is cancelled while the first
    measures, so it never starts and leaves no folder of its own; then the sweep is resumed."""
    cwd = tmp_path_factory.mktemp("slurm_pending")
    p, sched = slow_sweep(cluster, llama_server, cwd, "slow,smoke", "hydra.launcher.array_parallelism=1")
    job = f"{sched['array_job_id']}_1"
    with killed_on_failure(p):
        assert cluster.jobs().get(job) == "PENDING", cluster.jobs()
        cancel = cluster.run("scancel", job)
        assert cancel.returncode == 0, cancel.stderr
    rc, out, err = finish(p)
    d = sweep_dir(cwd)
    after_cancel = result(d / "1_llamacpp-tiny-fp16-smoke")
    statuses = {r["label"]: r["status"] for r in json.loads((d / "sweep.json").read_text())["runs"]}
    rrc, rout, rerr = finish(kvexp(cluster, ["resume", str(d)], cwd))
    return {"dir": d, "job": job, "rc": rc, "text": out + err, "result": after_cancel, "statuses": statuses,
            "resume_rc": rrc, "resume_text": rout + rerr}


@pytest.mark.timeout(400)
def test_a_job_cancelled_while_pending_fails_the_sweep_and_its_resume_runs_it(pending):
    text = pending["text"]
    assert pending["rc"] == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    named = [ln for ln in text.splitlines() if "llamacpp-tiny-fp16-smoke" in ln and "cancel" in ln.lower()]
    assert named and pending["job"] in named[0], text[-3000:]
    # the launcher gave the job that never started a failed result of its own, counted by the sweep
    smoke = pending["result"]
    assert smoke["status"] == "failed" and smoke["levels"] == []
    assert smoke["status_reason"].startswith(f"cancelled (Slurm job {pending['job']}: CANCELLED")
    assert pending["statuses"] == {SLOW_LABEL: "complete", "llamacpp-tiny-fp16-smoke": "failed"}
    # resumed: the finished job is kept (not submitted), the cancelled one measured
    rtext = pending["resume_text"]
    assert pending["resume_rc"] == 0, rtext[-3000:]
    assert "(finished: kept, not submitted)" in rtext
    smoke = result(pending["dir"] / "1_llamacpp-tiny-fp16-smoke")
    assert smoke["status"] == "complete" and len(smoke["levels"]) == 2
    statuses = {r["label"]: r["status"] for r in json.loads((pending["dir"] / "sweep.json").read_text())["runs"]}
    assert statuses == {SLOW_LABEL: "complete", "llamacpp-tiny-fp16-smoke": "complete"}


# ---------------------------------------------------------------- what Slurm refuses, and its time limit
def test_a_partition_that_does_not_exist_is_one_line(cluster, llama_server, tmp_path):
    resources = [r for r in RESOURCES if not r.startswith("hydra.launcher.partition=")]
    rc, out, err = finish(kvexp(cluster, ["-m", "kv=fp16,q8_0", f"backend.binary={llama_server}",
                                          "hydra/launcher=kvexp_slurm", "hydra.launcher.partition=nosuch",
                                          *resources], tmp_path))
    assert rc == 1, err[-3000:]
    assert err.strip().splitlines()[-1] == ("kvexp: Slurm refused the sweep's jobs, none was submitted: sbatch: error: "
                                            "Batch job submission failed: Invalid partition name specified")
    assert "Traceback" not in err and err.count("sbatch:") == 1, err[-3000:]
    assert not cluster.jobs()
    # nothing was submitted, so nothing is left behind: no sweep folder holding only Hydra's and submitit's files
    sweeps = tmp_path / "outputs" / "sweeps"
    assert not sweeps.is_dir() or not list(sweeps.iterdir()), list(sweeps.rglob("*"))


# a job that measures for ten minutes, in a sweep whose jobs may run one minute (Slurm's shortest limit)
LONG = SLOW.replace("name: slow", "name: long").replace("rates: [4]", "rates: [1]").replace("requests: 48",
                                                                                            "requests: 600")
LONG_LABEL = "llamacpp-tiny-fp16-long"


@pytest.fixture(scope="module")
def timed_out(cluster, llama_server, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("slurm_timeout")
    (cwd / "conf" / "scenario").mkdir(parents=True)
    (cwd / "conf" / "scenario" / "long.yaml").write_text(LONG)
    resources = [r for r in RESOURCES if not r.startswith("hydra.launcher.timeout_min=")]
    p = kvexp(cluster, ["-m", "scenario=long", f"hydra.searchpath=[file://{cwd / 'conf'}]",
                        f"backend.binary={llama_server}", "hydra/launcher=kvexp_slurm", "hydra.launcher.timeout_min=1",
                        "hydra.launcher.signal_delay_s=0", *resources], cwd)
    servers: dict[int, psutil.Process] = {}
    with killed_on_failure(p):
        while p.poll() is None:  # the hang guard is finish()'s and the test's timeout
            for q in cluster.job_processes():
                with contextlib.suppress(psutil.Error):
                    if q.name().startswith("llama-server"):
                        servers.setdefault(q.pid, q)
            time.sleep(0.5)
    rc, out, err = finish(p)
    return {"rc": rc, "text": out + err, "dir": sweep_dir(cwd), "servers": list(servers.values())}


@pytest.mark.timeout(600)
def test_a_job_killed_by_its_time_limit_is_one_line_and_leaves_no_server(cluster, timed_out):
    text = timed_out["text"]
    assert timed_out["rc"] == 1 and "Traceback" not in text, text[-3000:]
    # one line when it happened; the verdict at the end names it once more among the runs it left out
    named = [ln for ln in text.splitlines() if LONG_LABEL in ln and "TIMEOUT" in ln and not ln.startswith("verdict:")]
    assert len(named) == 1, text[-3000:]
    r = result(timed_out["dir"] / f"0_{LONG_LABEL}")
    assert r["status"] == "failed" and "TIMEOUT" in r["status_reason"], r["status_reason"]
    assert timed_out["servers"], "the job's llama-server was not seen"
    assert not [s for s in timed_out["servers"] if s.is_running() and s.status() != psutil.STATUS_ZOMBIE]
    assert not cluster.job_processes()  # nothing of the job is left on the node
    assert (timed_out["dir"] / "report" / "report.html").is_file()


# ---------------------------------------------------------------- ten jobs, two at a time
def _overlap(rows: list[tuple[str, str]]) -> int:
    """The most jobs running at once, from sacct's (Start, End) of each (ISO times sort as text)."""
    events = sorted([(s, 1) for s, _ in rows] + [(e, -1) for _, e in rows], key=lambda x: (x[0], x[1]))
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


@pytest.mark.timeout(900)
def test_ten_jobs_two_at_a_time_finish_into_one_report(cluster, llama_server, tmp_path):
    p = kvexp(cluster, ["-m", "scenario.seed=range(0,10)", "scenario.requests=4", f"backend.binary={llama_server}",
                        "hydra/launcher=kvexp_slurm", "hydra.launcher.array_parallelism=2", *RESOURCES], tmp_path)
    with killed_on_failure(p):
        _, err = p.communicate(timeout=840)
    assert p.returncode == 0, err[-3000:]
    d = sweep_dir(tmp_path)
    agg = json.loads((d / "sweep.json").read_text())
    assert check_file(d / "sweep.json") == [] and len(agg["runs"]) == 10
    assert {r["status"] for r in agg["runs"]} == {"complete"}
    assert (d / "report" / "report.html").is_file() and (d / "summary.md").is_file()
    (array,) = {result(f.parent)["environment"]["scheduler"]["array_job_id"] for f in d.glob("*/result.json")}
    acct = cluster.run("sacct", "-n", "-X", "-P", "-o", "JobID,State,Start,End", "-j", str(array)).stdout.splitlines()
    rows = [line.split("|") for line in acct if line.count("|") == 3]
    assert len(rows) == 10 and {r[1] for r in rows} == {"COMPLETED"}, acct
    assert _overlap([(r[2], r[3]) for r in rows]) <= 2, acct
    assert not cluster.job_processes()
