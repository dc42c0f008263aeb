"""Shared fixtures: the real llama-server (built once by `python -m kvexp install llamacpp`) and the
tiny GGUF kvexp writes itself."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

# A suite started in the background of a non-interactive shell (`cmd &`) inherits SIGINT ignored, and so
# would every kvexp the tests start and interrupt: they get Python's own handler back, as in a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
REFERENCE = ROOT.parent / "shared" / "reference" / "rtx5070ti-qwen2.5-7b.json"
FIXTURES = TESTS / "fixtures"  # every test names its recorded files from here, wherever the test sits


@pytest.fixture(scope="session")
def reference_path() -> Path:
    local = FIXTURES / "rtx5070ti-qwen2.5-7b.json"
    return local if local.is_file() else REFERENCE


# A skip whose reason starts with this names a condition CI cannot meet (no GPU, no AVX-512, one CPU);
# under CI (.ci/run sets it) every other skip, importorskip and skipif included, is a failure.
HARDWARE = "hardware: "


def hardware_skip(reason: str) -> None:
    """Skip for something CI's machine cannot have (its hardware), in CI too."""
    pytest.skip(HARDWARE + reason)


def missing(what: str, how: str) -> None:
    """A part CI installs is missing: a skip here, a failure in CI, whose .ci/run must provide it."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} is missing in CI: .ci/run must {how}", pytrace=False)
    pytest.skip(f"{what} is missing: {how}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI a skip that does not name a hardware condition fails: a missing server, library or tool
    must not turn into a green run."""
    report = (yield).get_result()
    if not (os.environ.get("CI") and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if reason.startswith("Skipped: "):
        reason = reason[len("Skipped: "):]
    if not reason.startswith(HARDWARE):
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, where every part must be present: {reason}"


def installed(found: Path | None, program: str, backend: str) -> Path:
    """A server program kvexp installs: skipped where it is missing, but a failure in CI, whose .ci/run
    must install it."""
    if found is None:
        missing(program, f"run `python -m kvexp install {backend}`")
    return found


@pytest.fixture(scope="session")
def llama_server() -> Path:
    from kvexp.assets.install import find_llama_server

    return installed(find_llama_server(), "llama-server", "llamacpp")


@pytest.fixture(scope="session")
def ollama() -> Path:
    from kvexp.assets.install import find_ollama

    return installed(find_ollama(), "ollama", "ollama")


@pytest.fixture(scope="session")
def tiny_gguf() -> Path:
    from kvexp.assets.tinymodels import ensure_tiny_gguf

    return ensure_tiny_gguf()


@pytest.fixture(autouse=True)
def _no_leftover_servers():
    """No server kvexp started may outlive a test."""
    yield
    from kvexp.backends import process

    leftover = [s.argv[0] for s in process._LIVE]
    process.stop_all()
    assert not leftover, f"servers left running after the test: {leftover}"


def run_watched(argv: list[str], program: str, timeout: float, **popen) -> tuple[subprocess.CompletedProcess, list]:
    """Run argv as a child process (output captured) and record, while it runs, every process under it
    whose program is named `program`; returns its CompletedProcess and those processes (psutil, which
    tells a live process from one whose pid was reused). Only this child's own tree is looked at: other
    servers on the machine (another test run's, a user's) are not this test's to count."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    got: dict[str, str] = {}

    def collect() -> None:
        got["out"], got["err"] = proc.communicate()

    reader = threading.Thread(target=collect, daemon=True)
    reader.start()
    seen: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + timeout  # a hang guard only
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(argv, timeout)
            seen_now(proc.pid, program, seen)
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(60)
    done = subprocess.CompletedProcess(argv, proc.returncode, got.get("out", ""), got.get("err", ""))
    return done, list(seen.values())


def seen_now(pid: int, program: str, seen: dict) -> None:
    """Add to `seen` the processes under pid (its whole tree) that run `program` now."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:  # it has just ended
        return
    for p in children:
        try:
            if program in Path(p.cmdline()[0]).name:  # the program itself, not a fork about to exec it
                seen.setdefault(p.pid, p)
        except (psutil.Error, IndexError):
            continue


def survivors(processes) -> list:
    """Those of `processes` (psutil) still running: neither ended nor a zombie waiting for its parent."""
    alive = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.Error:
            continue
    return alive


class LoopLags:
    """The test's own watch on the event loop a level runs on: every INTERVAL_S it sleeps and notes when it
    woke and how late (on the run's clock). How long the loop was stalled around a send (the machine's
    other work, the process off its core) is the yardstick, taken in the same run, for how late that send
    could be; the watch is the test's, not a figure kvexp computed."""

    INTERVAL_S = 0.005

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []  # (woke at, s on the run's clock; how late, s)
        self.origin = 0.0

    @property
    def lags(self) -> list[float]:
        return [lag for _, lag in self.samples]

    async def watch(self) -> None:
        import asyncio

        perf = time.perf_counter
        while True:
            t = perf()
            await asyncio.sleep(self.INTERVAL_S)
            now = perf()
            self.samples.append((now - self.origin, max(0.0, now - t - self.INTERVAL_S)))

    def stalled(self, start: float, end: float) -> tuple[float, int]:
        """How long within [start, end] the loop was seen stalled (each sample's lag is the stretch just
        before it woke), and how many samples that saw a stall of an interval or more overlap it."""
        total, stalls = 0.0, 0
        for woke, lag in self.samples:
            overlap = min(woke, end) - max(woke - lag, start)
            if overlap > 0:
                total += overlap
                stalls += lag >= self.INTERVAL_S
        return total, stalls

    def check_sends(self, requests: list[dict]) -> None:
        """Each request (a requests.jsonl row) was sent at its time, late by no more than its event loop
        was stalled meanwhile: plus one interval per stall seen (a stall shows up to an interval short)
        and one more, and the stretch before a start that until() waits by yielding (beyond it a start
        rests on the loop's millisecond timer). A client that held a send back while its loop was free (a
        cap, a queue, a coarse timer, a wait on another request) fails this on a quiet machine or a busy
        one; blocking work on the loop itself stalls the loop, and is kvexp's own client-limited check's."""
        from kvexp.measure.loadgen import SPIN_S

        assert self.samples, "the level ran on no event loop of this process: run it with client.workers=1"
        for r in requests:
            late = r["sent_s"] - r["scheduled_s"]
            stalled, stalls = self.stalled(r["scheduled_s"], r["sent_s"])
            allowed = stalled + (stalls + 1) * self.INTERVAL_S + SPIN_S
            assert late <= allowed, (f"request {r['index']} sent {late * 1000:.1f} ms late; its loop was stalled "
                                     f"{stalled * 1000:.1f} ms meanwhile")


@pytest.fixture
def loop_lags(monkeypatch) -> LoopLags:
    """A LoopLags watching every level this test runs on its own event loop."""
    import asyncio

    from kvexp.measure.loadgen import LoadGenerator

    out = LoopLags()
    measured = LoadGenerator.measured

    async def watched(self, sending):
        out.origin = self.origin
        watch = asyncio.get_running_loop().create_task(out.watch())
        try:
            return await measured(self, sending)
        finally:
            watch.cancel()

    monkeypatch.setattr(LoadGenerator, "measured", watched)
    return out


def pytest_configure(config):
    config.addinivalue_line("markers", "under_load: runs a busy loop on one core beside timing-sensitive checks")


INTEGRATION = TESTS / "integration"
SERVERS = ("llamacpp", "vllm", "ollama", "slurm", "browser")  # the markers of tests/integration/<server>/
SERVER_FIXTURES = {"llama_server": "llamacpp", "ollama": "ollama"}


def pytest_collection_modifyitems(config, items):
    """`integration` and the server's marker on every test that needs a real server: each test under
    tests/integration/ (its folder names the server; in tests/integration/ itself, its `backend` parameter
    does), and a test anywhere that takes a server fixture or carries a server's marker. `pytest -m "not
    integration"` is then the suite that starts no real server, wherever a test was written."""
    for item in items:
        path = Path(item.path)
        servers = {m.name for m in item.iter_markers() if m.name in SERVERS}
        servers |= {SERVER_FIXTURES[f] for f in getattr(item, "fixturenames", ()) if f in SERVER_FIXTURES}
        real = bool(servers)
        if path.is_relative_to(INTEGRATION):
            real = True
            folder = path.relative_to(INTEGRATION).parts
            if len(folder) > 1 and folder[0] in SERVERS:
                servers.add(folder[0])
            backend = getattr(getattr(item, "callspec", None), "params", {}).get("backend")
            if backend in SERVERS:
                servers.add(backend)
        if real:
            item.add_marker("integration")
        for server in sorted(servers - {m.name for m in item.iter_markers()}):
            item.add_marker(server)


@pytest.fixture(autouse=True, scope="session")
def _private_calibration(tmp_path_factory):
    """Jobs run by the tests learn into a calibration file of their own, not the user's."""
    old = os.environ.get("KVEXP_CALIBRATION")
    os.environ["KVEXP_CALIBRATION"] = str(tmp_path_factory.mktemp("cal") / "calibration.json")
    yield
    if old is None:
        os.environ.pop("KVEXP_CALIBRATION", None)
    else:
        os.environ["KVEXP_CALIBRATION"] = old


SUBCOMMANDS = ("validate", "report", "results", "plan", "install", "resume", "cleanup", "--help", "-h", "--version")


# The tests' defaults: the tiny model kvexp writes itself and the smoke scenario (the shipped defaults
# are the real SmolLM2 and the cpu scenario); an override given after these wins.
TINY = ["model=tiny", "scenario=smoke"]


def with_tiny(args) -> list[str]:
    """A kvexp command line on the tests' defaults, unless it is a subcommand."""
    args = list(args)
    if args and args[0] in SUBCOMMANDS:
        return args
    flags = 0  # Hydra's own flags (-m, --multirun) come before the overrides
    while flags < len(args) and str(args[flags]).startswith("-"):
        flags += 1
    given = {str(a).split("=", 1)[0] for a in args[flags:]}
    return [*args[:flags], *(t for t in TINY if t.split("=", 1)[0] not in given), *args[flags:]]


def kvexp_main(*args: str) -> int:
    """kvexp's main in this process on the tests' defaults, releasing its folder locks afterwards."""
    from kvexp.app import preflight
    from kvexp.app.cli import main

    try:
        return main(with_tiny(args))
    finally:
        preflight.unlock_all()


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under folder (hidden ones included) and the hash of its bytes."""
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}
