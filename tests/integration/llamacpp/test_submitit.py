"""A sweep through Hydra's submitit launcher (real submitit, local processes) on the tiny llama.cpp
model: the same files and report as the basic launcher, failures in other processes counted in the
exit status, and the Slurm launcher config that ships with kvexp."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import with_tiny, TINY

from kvexp.results.validate import check_file

SWEEP = ["-m", "kv=fp16,q8_0", "scenario=smoke"]


def servers_left(folder: Path) -> list[str]:
    """Processes still writing a log under `folder` (a server a job started and did not stop); other
    people's servers on this machine are not ours to count."""
    import psutil

    left = []
    for proc in psutil.process_iter(["pid", "name"]):
        try:
            if any(Path(f.path).is_relative_to(folder) for f in proc.open_files()):
                left.append(f"{proc.info['pid']} {proc.info['name']}")
        except (psutil.Error, OSError):
            continue
    return left


def kvexp(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvexp", *with_tiny(args)], capture_output=True, text=True, cwd=cwd, timeout=300)


def sweep_dir(cwd: Path) -> Path:
    (d,) = (cwd / "outputs" / "sweeps").iterdir()
    return d


def files(d: Path) -> set[str]:
    """What a sweep left, without submitit's own folder and the report's chart images."""
    return {str(p.relative_to(d)) for p in d.rglob("*")
            if p.is_file() and ".submitit" not in p.parts and "charts" not in p.parts}


@pytest.fixture(scope="module")
def sweeps(llama_server, tmp_path_factory):
    out = {}
    for launcher in ("basic", "submitit_local"):
        cwd = tmp_path_factory.mktemp(launcher)
        extra = [] if launcher == "basic" else ["hydra/launcher=submitit_local"]
        p = kvexp([*SWEEP, f"backend.binary={llama_server}", *extra], cwd)
        assert p.returncode == 0, p.stderr[-3000:]
        out[launcher] = (sweep_dir(cwd), p)
    return out


def test_submitit_sweep_leaves_what_the_basic_launcher_leaves(sweeps):
    basic, submitit = sweeps["basic"][0], sweeps["submitit_local"][0]
    assert (submitit / ".submitit").is_dir()  # the jobs did run through submitit
    assert files(submitit) == files(basic)
    assert {"sweep.json", "summary.md", "0_llamacpp-tiny-fp16-smoke/result.json",
            "1_llamacpp-tiny-q8_0-smoke/requests.jsonl"} <= files(submitit)
    for d in (basic, submitit):
        for f in sorted(d.glob("*/result.json")) + sorted(d.glob("*/requests.jsonl")) + [d / "sweep.json"]:
            assert check_file(f) == [], f


def test_the_sweep_report_gathers_jobs_from_other_processes(sweeps):
    for d, p in sweeps.values():
        agg = json.loads((d / "sweep.json").read_text())
        assert [(r["label"], r["status"]) for r in agg["runs"]] == [
            ("llamacpp-tiny-fp16-smoke", "complete"), ("llamacpp-tiny-q8_0-smoke", "complete")]
        assert all(len(r["levels"]) == 2 for r in agg["runs"])
        text = (d / "summary.md").read_text()
        assert "| llamacpp-tiny-q8_0-smoke |" in text and "## Where the time went" in text
        assert "sweep: 2 job(s): 2 server start(s) for 2 distinct server configuration(s)" in p.stdout + p.stderr
        assert not servers_left(d)


def test_a_job_that_fails_in_another_process_fails_the_sweep(llama_server, tmp_path):
    p = kvexp(["-m", "hydra/launcher=submitit_local", "scenario=smoke", f"backend.binary={llama_server}",
               "backend.extra_args=[--lora,/nonexistent/adapter.gguf]"],  # a flag it reads; it exits loading the file
              tmp_path)
    assert p.returncode == 1
    assert "1 job(s) failed: llamacpp-tiny-fp16-smoke" in p.stderr
    (res,) = sweep_dir(tmp_path).glob("*/result.json")
    assert json.loads(res.read_text())["status"] == "failed"
    assert "| failed |" in (sweep_dir(tmp_path) / "summary.md").read_text()  # the sweep is summarised all the same
    assert not servers_left(tmp_path)


@pytest.mark.filterwarnings(r"ignore:\s*'hydra/launcher/submitit_slurm' is validated:UserWarning")
def test_slurm_launcher_config_asks_one_gpu_per_job():
    from hydra import compose, initialize_config_dir
    from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf

    from kvexp.app.checks import register_configs
    from kvexp.core.paths import data_dir

    register_configs()

    with initialize_config_dir(config_dir=str(data_dir("conf")), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["hydra/launcher=submitit_slurm", "hydra.launcher.partition=gpu"],
                      return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher.gpus_per_node == 1 and launcher.tasks_per_node == 1 and launcher.partition == "gpu"
    # every key the plugin knows, and no other: a plugin upgrade that changes them shows here
    assert set(launcher) == {f.name for f in dataclasses.fields(SlurmQueueConf)}
    # kvexp's subclass runs it: a cancelled job is a line and a failed result, not a traceback
    from hydra_plugins.kvexp_launcher.slurm import TARGET, KvexpSlurmLauncher

    assert launcher._target_ == TARGET and KvexpSlurmLauncher.__module__ + ".KvexpSlurmLauncher" == TARGET


def test_job_statuses_count_a_job_that_left_no_result(tmp_path):
    from kvexp.app.compose import compose
    from kvexp.measure.runner import unrun_result
    from kvexp.report.summary import job_statuses

    (tmp_path / "0_llamacpp-tiny-q8_0-smoke" / ".hydra").mkdir(parents=True)  # its process died early
    unrun_result(compose(TINY), tmp_path / "1_llamacpp-tiny-fp16-smoke", "for the test")
    (tmp_path / ".submitit").mkdir()
    assert job_statuses(tmp_path) == {"llamacpp-tiny-q8_0-smoke": "missing", "llamacpp-tiny-fp16-smoke": "skipped"}
