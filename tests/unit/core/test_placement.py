"""Client and server apart (kvexp/core/placement.py): the plan for every setting and machine shape, a
real process pinned before it runs (and what it starts inherits it), the client's thread pinned while it
measures and put back, the threads a server gets by default, and a refused split in one line."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest
from conftest import TINY

from kvexp.app.compose import compose
from kvexp.backends.process import ServerProcess
from kvexp.core import placement
from kvexp.core.config import ConfigError

TWO_CPUS = len(os.sched_getaffinity(0)) >= 2


def cfg(*overrides: str):
    return compose([*TINY, *overrides])


def test_auto_gives_the_client_the_last_cpu_and_the_server_the_rest():
    p = placement.plan(cfg(), cpus=[0, 1, 2, 3])
    assert (p.mode, p.server_cpus, p.client_cpus) == ("split", (0, 1, 2), (3,))
    assert p.server_threads == 3
    p = placement.plan(cfg(), cpus=[2, 5])  # a container's share: its own CPU numbers
    assert (p.server_cpus, p.client_cpus) == ((2,), (5,))


def test_the_client_gets_a_cpu_per_worker_it_may_start_and_leaves_the_server_one():
    assert placement.plan(cfg("client.workers=3"), cpus=list(range(8))).client_cpus == (5, 6, 7)
    assert placement.plan(cfg("client.workers=3"), cpus=[0, 1]).client_cpus == (1,)
    # auto: a CPU per 64 concurrent streams
    wide = cfg("scenario.concurrency=[1,256]", "scenario.requests=256")
    assert placement.plan(wide, cpus=list(range(16))).client_cpus == (12, 13, 14, 15)


def test_shared_one_cpu_and_attached_servers_are_not_pinned():
    for overrides, cpus, why in ((["client.placement=shared"], [0, 1], "client.placement=shared"),
                                 ([], [0], "one CPU"),
                                 (["backend.endpoint=http://127.0.0.1:9"], [0, 1], "attached server")):
        p = placement.plan(cfg(*overrides), cpus=cpus)
        assert (p.mode, p.server_cpus, p.client_cpus) == ("shared", None, None) and why in p.reason
        assert p.to_json()["server_cpus"] is None
    assert placement.plan(cfg("client.placement=shared"), cpus=[0, 1, 2]).server_threads == \
        max(1, len(os.sched_getaffinity(0)) - 1)


@pytest.mark.parametrize("backend", ["llamacpp", "vllm", "ollama"])
def test_auto_places_every_backend_alike(backend):
    """No server is left to place itself: vLLM's CPU build is split like llama-server and Ollama, and
    told the same CPUs for its OpenMP threads (test_fair_field.py checks each real server's tree)."""
    p = placement.plan(cfg(f"backend={backend}"), cpus=[0, 1])
    assert (p.mode, p.server_cpus, p.client_cpus) == ("split", (0,), (1,))


def test_a_split_that_cannot_be_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^client.placement=split needs 2 or more CPUs; kvexp may use 1$"):
        placement.plan(cfg("client.placement=split"), cpus=[0])
    with pytest.raises(ConfigError, match="attached server"):
        placement.plan(cfg("client.placement=split", "backend.endpoint=http://127.0.0.1:9"), cpus=[0, 1])


def test_the_refusal_comes_before_anything_starts(tmp_path):
    p = subprocess.run(["taskset", "-c", "0", sys.executable, "-m", "kvexp", *TINY, "client.placement=split"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert p.returncode == 1
    assert p.stderr == "kvexp: client.placement=split needs 2 or more CPUs; kvexp may use 1\n"
    assert not (tmp_path / "outputs").exists()


@pytest.mark.skipif(not TWO_CPUS, reason="hardware: pinning apart needs 2 CPUs")
def test_a_launched_process_and_what_it_starts_run_on_the_servers_cpus(tmp_path):
    first = min(os.sched_getaffinity(0))
    proc = ServerProcess(["sh", "-c", "sleep 30 & wait"], {}, tmp_path / "log", "test server", 1.0, cpus=(first,))
    proc.start()
    try:
        assert placement.cpus_of(proc.pid) == [first]
        end = time.monotonic() + 30
        while not psutil.Process(proc.pid).children() and time.monotonic() < end:
            time.sleep(0.05)
        (child,) = psutil.Process(proc.pid).children()
        assert child.cpu_affinity() == [first]  # inherited: a server's runner or engine process too
    finally:
        proc.stop()
    assert proc.exited() is not None


@pytest.mark.skipif(not TWO_CPUS, reason="hardware: pinning apart needs 2 CPUs")
def test_the_client_runs_on_its_cpus_while_it_measures_and_goes_back_after():
    before = os.sched_getaffinity(0)
    p = placement.plan(cfg(), cpus=sorted(before))
    with placement.client_side(p):
        assert os.sched_getaffinity(0) == set(p.client_cpus)
        probe = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                               capture_output=True, text=True, check=True)
        assert probe.stdout.strip() == str(list(p.client_cpus))  # a worker process started here inherits it
    assert os.sched_getaffinity(0) == before
    with pytest.raises(RuntimeError), placement.client_side(p):
        raise RuntimeError("a level failed")
    assert os.sched_getaffinity(0) == before


def test_a_cpu_the_process_may_not_use_fails_the_launch_in_one_line(tmp_path):
    proc = ServerProcess(["sleep", "30"], {}, tmp_path / "log", "test server", 1.0, cpus=(4095,))
    from kvexp.backends.base import BackendError

    with pytest.raises(BackendError, match=r"^test server: cannot launch sleep on CPUs \(4095,\)"):
        proc.start()


def test_a_server_gets_as_many_threads_as_cpus_by_default():
    from kvexp.backends import create

    a = create(cfg(), locate=False)
    if a.placement.server_cpus:
        assert a.threads == len(a.placement.server_cpus) and a.spec.cpus == a.placement.server_cpus
    assert create(cfg("backend.threads=3"), locate=False).threads == 3


def test_a_sweep_over_several_backends_places_every_server_alike():
    from kvexp.backends import create

    plans = {b: create(cfg(f"backend={b}"), locate=False).placement for b in ("llamacpp", "vllm", "ollama")}
    assert len({(p.mode, p.server_cpus, p.client_cpus) for p in plans.values()}) == 1, plans
