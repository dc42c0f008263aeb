"""kvexp killed with SIGKILL mid-level takes every process its server started with it (vLLM's engine core,
workers and resource tracker; Ollama's runner), and a complete run leaves nothing outside kvexp's folders:
on the real llama-server, vLLM and Ollama.

Only the processes the run started are looked at: kvexp's own tree, and every process of the sessions its
children run in (a server's children that its death reparented to pid 1 stay in its session), never every
server on the machine. Each run gets a HOME and a TMPDIR of its own, so that whatever a server writes there
instead of kvexp's folders shows; a file a server opens for writing or a socket it binds in the real /tmp
or home, outside kvexp's folders, is seen while it runs, and so is the shared memory they map, which must
be gone at the end."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import survivors
from unit.app.test_interrupts import Kvexp

from kvexp.core.paths import cache_dir

GONE_DEADLINE_S = 120  # a hang guard only: the test asserts what is left, and prints how long it took
BACKENDS = ["llamacpp", "vllm", "ollama"]


class RunProcesses:
    """Every process a kvexp run started, sampled while it runs: kvexp's descendants and the members of
    their sessions (kvexp's own session, the test's, aside); and the paths they write or bind."""

    def __init__(self, k: Kvexp):
        self.k = k
        self.own_sid = os.getsid(k.proc.pid)
        self.sids: set[int] = set()
        self.seen: dict[int, psutil.Process] = {}
        self.written: set[str] = set()
        self.scratch: set[str] = set()
        self.shm: set[str] = set()  # /dev/shm segments they mapped
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(0.1)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def sample(self) -> list[psutil.Process]:
        try:
            now = psutil.Process(self.k.proc.pid).children(recursive=True)
        except psutil.Error:  # kvexp has ended
            now = []
        for p in now:
            try:
                if (sid := os.getsid(p.pid)) != self.own_sid:
                    self.sids.add(sid)
                argv = p.cmdline()
            except (OSError, psutil.Error):
                continue
            if len(argv) > 7 and argv[3].endswith("watcher.py"):
                self.scratch.add(argv[7])  # the server's TMPDIR, as kvexp gave it to the watcher
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) in self.sids:
                    now.append(p)
            except OSError:
                continue
        for p in now:
            p = self.seen.setdefault(p.pid, p)
            try:
                self.written.update(f.path for f in p.open_files() if f.mode != "r")
                self.written.update(c.laddr for c in p.net_connections(kind="unix") if c.laddr)
                with open(f"/proc/{p.pid}/maps") as maps:
                    self.shm.update(line.split(None, 5)[5].strip() for line in maps if " /dev/shm/" in line)
            except (psutil.Error, OSError, IndexError):
                continue
        return now

    def shm_left(self) -> list[str]:
        """The shared memory the run's processes mapped that is still there (each segment of vLLM's is
        160-250 MB that only a reboot or a hand frees once nobody unlinks it)."""
        return sorted(p for p in self.shm if Path(p).exists())

    def named(self, word: str) -> list[psutil.Process]:
        out = []
        for p in survivors(self.seen.values()):
            try:
                if word in " ".join(p.cmdline()) or word in p.name():
                    out.append(p)
            except psutil.Error:
                continue
        return out


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return "?"


def _args(backend: str, request, *extra: str) -> list[str]:
    if backend == "llamacpp":
        return [f"backend.binary={request.getfixturevalue('llama_server')}", *extra]
    if backend == "ollama":
        return ["backend=ollama", f"backend.binary={request.getfixturevalue('ollama')}", *extra]
    from kvexp.assets.install import vllm_python

    if vllm_python() is None:
        if os.environ.get("CI"):
            pytest.fail("the vLLM venv is missing in CI: .ci/run must run `python -m kvexp install vllm`")
        pytest.skip("no vLLM CPU venv in kvexp's cache: run `python -m kvexp install vllm`")
    return ["backend=vllm", *extra]


# a process each backend starts besides the server itself: what a SIGKILL of kvexp used to leave running
CHILD = {"llamacpp": None, "vllm": "VLLM::EngineCore", "ollama": "runner"}


def _home_env(tmp_path: Path) -> dict[str, str]:
    """kvexp on a HOME and a TMPDIR of its own (kvexp's cache where it is, with the servers and models)."""
    for d in ("home", "tmp"):
        (tmp_path / d).mkdir()
    return {**os.environ, "PYTHONUNBUFFERED": "1", "HOME": str(tmp_path / "home"), "TMPDIR": str(tmp_path / "tmp"),
            "KVEXP_CACHE": str(cache_dir()), "KVEXP_CALIBRATION": str(tmp_path / "cal.json"),
            # the report's matplotlib keeps its font cache where the user's is: the client, not a server
            "MPLCONFIGDIR": str(tmp_path / "mpl")}


@pytest.mark.parametrize("backend", BACKENDS)
def test_sigkill_of_kvexp_mid_level_ends_every_process_of_its_server(backend, request, tmp_path):
    env = _home_env(tmp_path)
    k = Kvexp(_args(backend, request, "scenario.requests=400", "scenario.concurrency=[2]"), tmp_path, env,
              server=backend)
    run = RunProcesses(k)
    try:
        k.wait_for(": 400 requests", timeout=900)  # the level has begun
        child = CHILD[backend]
        while child and not run.named(child):  # the runner starts with the first request
            assert k.proc.poll() is None, k.output[-3000:]
            time.sleep(0.1)
        before = survivors(run.sample())
        names = sorted({_name(p) for p in before})
        assert k.proc.poll() is None and len(before) >= 2, k.output[-3000:]  # a server and its watcher
        t = time.monotonic()
        k.proc.kill()
        k.proc.wait()
        deadline = t + GONE_DEADLINE_S
        while survivors(run.seen.values()) and time.monotonic() < deadline:
            run.sample()  # still by session: a process reparented to pid 1 is found there
            time.sleep(0.1)
        gone_s = time.monotonic() - t
    finally:
        run.close()
    left = [(p.pid, _name(p)) for p in survivors(run.seen.values())]
    print(f"\n{backend}: {len(before)} processes of the run ({names}) ended {gone_s:.1f} s after kvexp's SIGKILL")
    assert not left, f"left after kvexp was killed: {left}"
    assert not run.shm_left(), f"shared memory left: {run.shm_left()}"
    assert run.scratch and not [s for s in run.scratch if Path(s).exists()]  # the watcher removed it
    from kvexp.backends import launched

    assert not [r for r in launched.records() if r.kvexp_pid == k.proc.pid]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_complete_run_leaves_nothing_outside_kvexps_folders(backend, request, tmp_path):
    env = _home_env(tmp_path)
    k = Kvexp(_args(backend, request, f"hydra.run.dir={tmp_path}/run"), tmp_path, env, server=backend)
    run = RunProcesses(k)
    try:
        assert k.finish(timeout=900) == 0, k.output[-3000:]
    finally:
        run.close()
    assert len(run.seen) >= 2 and not survivors(run.seen.values())
    assert not run.shm_left(), f"shared memory left: {run.shm_left()}"
    assert sorted(p.name for p in (tmp_path / "home").rglob("*")) == []  # no ~/.ollama, ~/.cache/vllm, ...
    assert sorted(p.name for p in (tmp_path / "tmp").rglob("*")) == []  # no vLLM IPC socket, no folder
    assert run.scratch and not [s for s in run.scratch if Path(s).exists()]  # the server's TMPDIR, removed
    kvexp_own = (str(cache_dir()) + os.sep, str(tmp_path) + os.sep, "/dev/")
    outside = sorted(p for p in run.written if p.startswith("/") and not p.startswith(kvexp_own))
    assert not outside, f"written or bound outside kvexp's folders: {outside}"
