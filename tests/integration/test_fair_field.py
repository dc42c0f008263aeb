"""A fair field on the CPU: every process of every server runs on the CPUs kvexp placed it on, and the
result records what was applied. On the real llama-server, vLLM's CPU build (API server, engine core,
its OpenMP threads, which it binds itself) and Ollama (its runner), this test reads back, while the run
goes on, the CPUs every thread of the server's process tree may run on, with its own reading of /proc,
and holds them against the job's environment.placement."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import FIXTURES, hardware_skip
from unit.app.test_interrupts import Kvexp
from integration.test_sigkill import BACKENDS, _args

from kvexp.analysis import comparable
from kvexp.results.runs import Placement, Run
from kvexp.results.store import load_document


PROGRAM = {"llamacpp": "llama-server", "vllm": "vllm", "ollama": "ollama"}  # in the server's command line
# a process each backend starts besides the server: its name (15 characters at most) or command line
CHILD = {"llamacpp": None, "vllm": "VLLM::EngineCor", "ollama": "runner"}


def is_server(backend: str, argv: list[str]) -> bool:
    """The server process itself: not a probe kvexp runs with the same program (llama-server --help, the vLLM
    venv's python asked whether vllm imports)."""
    if not argv or "--help" in argv:
        return False
    if backend == "vllm":
        return "vllm.entrypoints.openai.api_server" in argv
    return Path(argv[0]).name.startswith(PROGRAM[backend]) and (backend != "ollama" or argv[1:2] == ["serve"])


class TreeWatch:
    """Every thread of every process under the servers kvexp runs, sampled every 0.1 s: the CPUs each
    may run on (sched_getaffinity of the thread id) and the processes' names and command lines."""

    def __init__(self, k: Kvexp, backend: str):
        self.k, self.backend = k, backend
        self.cpus: dict[int, set[int]] = {}  # pid -> union of its threads' CPUs over the run
        self.names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                under = psutil.Process(self.k.proc.pid).children(recursive=True)
            except psutil.Error:  # kvexp has ended
                under = []
            for root in under:
                try:
                    if not is_server(self.backend, root.cmdline()):
                        continue
                    tree = [root, *root.children(recursive=True)]
                except psutil.Error:
                    continue
                for p in tree:
                    try:
                        tids = [int(t) for t in os.listdir(f"/proc/{p.pid}/task")]
                        self.names[p.pid] = f"{p.name()}: {' '.join(p.cmdline()[:3])}"
                    except (OSError, psutil.Error):
                        continue
                    for tid in tids:
                        try:
                            self.cpus.setdefault(p.pid, set()).update(os.sched_getaffinity(tid))
                        except OSError:  # the thread has ended
                            continue
            time.sleep(0.1)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_process_of_each_server_runs_on_the_cpus_kvexp_recorded(backend, request, tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        hardware_skip("a fair field apart from the client needs 2 CPUs")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVEXP_CALIBRATION": str(tmp_path / "cal.json")}
    k = Kvexp(_args(backend, request, "scenario.concurrency=[2]", "scenario.requests=8"), tmp_path, env,
              server=PROGRAM[backend])
    watch = TreeWatch(k, backend)
    try:
        rc = k.finish(timeout=900)
    finally:
        watch.close()
    assert rc == 0, k.output[-3000:]
    (path,) = (tmp_path / "outputs").rglob("result.json")
    result = load_document(path)[1]
    placed = result["environment"]["placement"]
    server, client = set(placed["server_cpus"]), set(placed["client_cpus"])
    assert placed["mode"] == "split" and server and client and not server & client, placed

    # what this test saw, thread by thread, while the run went on
    assert watch.cpus, k.output[-3000:]
    assert {pid: sorted(c) for pid, c in watch.cpus.items() if c != server} == {}, watch.names
    if CHILD[backend]:  # the runner, the engine core: started by the server, and on its CPUs too
        assert any(CHILD[backend] in name for name in watch.names.values()), watch.names

    # what kvexp recorded is what was applied: every thread of every process read back during the run
    assert set(placed["server_cpus_seen"]) == server
    recorded = {p["pid"]: set(p["cpus"]) for p in placed["server_processes"]}
    assert recorded and all(c == server for c in recorded.values()), placed["server_processes"]
    assert set(recorded) <= set(watch.cpus), (recorded, watch.names)
    if CHILD[backend]:
        assert len(recorded) >= 2, placed["server_processes"]  # the runner or engine core is in the record
    assert comparable.placement_key(Run(placement=Placement.from_json(placed))) == ("split", tuple(sorted(server)))


def test_runs_whose_servers_ran_on_other_cpus_are_not_compared(tmp_path):
    """Two real llama-server jobs, placed alike: compared. The same pair where one server's processes were
    read back on more CPUs than it was pinned to (a server that set its threads' CPUs itself): the CPU
    budget differed, so they are not compared, and the reason names both placements."""
    import json

    from kvexp.analysis.aggregate import collect

    real = FIXTURES / "decision"
    docs = {kv: json.loads((real / kv / "result.json").read_text()) for kv in ("fp16", "q8_0")}
    for d in docs.values():
        for lv in d["levels"]:
            lv["machine"] = {"load_avg_1m": 1.0, "cores": 2, "busy_share": 0.9, "steal_share": 0.0}

    def verdict(folder: str) -> dict:
        paths = []
        for kv, d in docs.items():
            (tmp_path / folder / kv).mkdir(parents=True)
            (tmp_path / folder / kv / "result.json").write_text(json.dumps(d))
            paths.append(tmp_path / folder / kv / "result.json")
        (v,) = collect(paths).verdicts
        return v

    assert verdict("alike")["excluded"] == []
    docs["q8_0"]["environment"]["placement"]["server_cpus_seen"] = [0, 1]
    v = verdict("apart")
    assert v["choice"] == [] and len(v["excluded"]) == 2
    assert any("another CPU placement (the server's processes on CPUs 0,1 against the server's processes on CPU 0)"
               in x or "another CPU placement (the server's processes on CPU 0 against the server's processes on "
               "CPUs 0,1)" in x for x in v["excluded"]), v["excluded"]
