"""Ctrl-C during `python -m kvexp report` and `python -m kvexp install`: one line on stderr, no traceback, exit
status 130, as for a run; an install cut short leaves no half-written file where kvexp looks for a whole
one, and no step of it running."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FIXTURES, ROOT

from kvexp.app import cli
from kvexp.app.cli import main


def this_tree() -> dict[str, str]:
    """The environment for `python -m kvexp` from this checkout (whatever another install put on the path)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


def wait_until(done, proc: subprocess.Popen, what: str, timeout: float = 120) -> None:
    """A hang guard only: wait for done() while proc runs."""
    deadline = time.monotonic() + timeout
    while not done():
        assert proc.poll() is None, f"kvexp ended before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.02)


def interrupt(proc: subprocess.Popen, whole_group: bool) -> tuple[int, str, str]:
    """SIGINT as a terminal's Ctrl-C sends it (to the whole foreground group) or to kvexp alone."""
    if whole_group:
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


# ---------------------------------------------------------------------------------------------- report
@pytest.fixture(scope="module")
def big_aggregate(tmp_path_factory) -> Path:
    """The reference sweep's runs repeated to 100 (labels varied): a report of some seconds to lay out."""
    agg = json.loads((FIXTURES / "rtx5070ti-qwen2.5-7b.json").read_text())
    base, runs = agg["runs"], []
    for i in range(100):
        run = copy.deepcopy(base[i % len(base)])
        run["label"] = f"{run['label']}-v{i // len(base)}"
        runs.append(run)
    agg["runs"] = runs
    path = tmp_path_factory.mktemp("big") / "sweep.json"
    path.write_text(json.dumps(agg))
    return path


@pytest.mark.parametrize("stage, given", [("reading", False), ("pdf", False), ("pdf", True)],
                         ids=["reading", "pdf", "pdf-into-a-folder-given"])
def test_ctrl_c_during_report_prints_one_line(big_aggregate, tmp_path, stage, given):
    """One line, 130; the folder the report made is removed (it held the charts alone), and a folder it
    was given keeps what it held, the line saying it may hold part of this report."""
    out = tmp_path / "report"
    if given:
        out.mkdir()
        (out / "notes.md").write_text("mine")
    proc = subprocess.Popen([sys.executable, "-m", "kvexp", "report", str(big_aggregate), "--out", str(out)],
                            cwd=tmp_path, env=this_tree(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        if stage == "reading":  # the input read, the output folder made
            wait_until(out.is_dir, proc, "output folder")
        else:  # Markdown and HTML written: the PDF is being laid out (in worker processes on 2+ CPUs)
            wait_until((out / "report.html").is_file, proc, "report.html")
        rc, stdout, stderr = interrupt(proc, whole_group=True)
    finally:
        if proc.poll() is None:
            proc.kill()
    note = f"{out} may hold a half-written report" if given else "nothing half-written is kept"
    assert (rc, stderr) == (130, f"kvexp report: interrupted by SIGINT; {note}\n"), stderr[-3000:]
    assert "Traceback" not in stdout and out.exists() == given
    if given:
        assert (out / "notes.md").read_text() == "mine" and not (out / "report.pdf").exists()
        assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]  # no half-written file


# --------------------------------------------------------------------------------------------- install
@pytest.fixture
def slow_pip(tmp_path) -> dict[str, str]:
    """An environment where `python -m pip` (every download step of an install) is a stand-in that notes
    its pid and sleeps; kvexp's cache and temporary folders under tmp_path."""
    fake = tmp_path / "fake" / "pip"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "__main__.py").write_text("import os, time\n"
                                      "open(os.environ['FAKE_PIP_PID'], 'w').write(str(os.getpid()))\n"
                                      "time.sleep(600)\n")
    for d in ("cache", "tmp"):
        (tmp_path / d).mkdir()
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), str(ROOT)]),
            "KVEXP_CACHE": str(tmp_path / "cache"),
            "TMPDIR": str(tmp_path / "tmp"), "FAKE_PIP_PID": str(tmp_path / "pip.pid")}


@pytest.mark.parametrize("whole_group", [True, False], ids=["terminal-ctrl-c", "kvexp-alone"])
def test_ctrl_c_during_install_prints_one_line_and_keeps_nothing_half_done(tmp_path, slow_pip, whole_group):
    proc = subprocess.Popen([sys.executable, "-m", "kvexp", "install"], cwd=tmp_path, env=slow_pip,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    pid_file = tmp_path / "pip.pid"
    try:
        wait_until(lambda: pid_file.is_file() and pid_file.read_text(), proc, "the download step")
        rc, stdout, stderr = interrupt(proc, whole_group)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (rc, stderr) == (130, "kvexp install: interrupted by SIGINT; nothing half-installed is kept\n"), stderr
    assert "Traceback" not in stdout
    assert "kvexp install: downloading the llama.cpp sources" in stdout  # it was inside the step
    pip = int(pid_file.read_text())
    assert not Path(f"/proc/{pip}").exists() or "zombie" in Path(f"/proc/{pip}/status").read_text()  # the step ended
    assert not list((tmp_path / "tmp").iterdir())  # the build folder removed
    assert not (tmp_path / "cache" / "bin").exists()  # no program, whole or half


def test_an_install_cut_short_removes_its_half_written_files(tmp_path, monkeypatch, capsys):
    """In this process: SIGINT while a built program is being copied (its `.tmp` half written) and while a
    new vLLM venv is being filled; a venv that already held vLLM is kept."""
    from kvexp.assets import install
    from kvexp.backends import REGISTRY

    monkeypatch.setenv("KVEXP_CACHE", str(tmp_path / "cache"))
    old = signal.getsignal(signal.SIGINT)

    def copying(cls, force=False):
        half = install.cached_llama_tool("llama-server").with_suffix(".tmp")
        half.parent.mkdir(parents=True)
        half.write_bytes(b"\x7fELF half")
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the signal lands here
        raise AssertionError("SIGINT did not interrupt the install")

    monkeypatch.setattr(REGISTRY["llamacpp"], "install", classmethod(copying))
    assert main(["install", "llamacpp"]) == 130
    assert capsys.readouterr().err == "kvexp install: interrupted by SIGINT; nothing half-installed is kept\n"
    assert not list((tmp_path / "cache" / "bin").iterdir())
    assert signal.getsignal(signal.SIGINT) is old  # handlers restored

    venv = install.vllm_venv()

    def filling(cls, force=False):
        (venv / "bin").mkdir(parents=True, exist_ok=True)
        (venv / "bin" / "python").write_text("")
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
        raise AssertionError("SIGINT did not interrupt the install")

    monkeypatch.setattr(REGISTRY["vllm"], "install", classmethod(filling))
    assert main(["install", "vllm"]) == 130
    assert not venv.exists()  # it held no vLLM before: all of it was this install's, half done
    capsys.readouterr()
    held = venv / "lib" / "python3.11" / "site-packages" / "vllm" / "__init__.py"
    held.parent.mkdir(parents=True)
    held.write_text("")
    (venv / "bin").mkdir()
    (venv / "bin" / "python").write_text("")
    assert install.vllm_python() is not None
    assert main(["install", "vllm"]) == 130
    assert held.is_file()  # kept as found


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1])
@pytest.mark.parametrize("after_s", [0.5, None])  # while Python loads kvexp (about 1 s), or once it validates
def test_a_signal_during_validate_or_while_loading_prints_one_line(big_aggregate, tmp_path, after_s, sig):
    files = [tmp_path / f"copy{i}.json" for i in range(200)]
    for f in files:
        f.write_bytes(big_aggregate.read_bytes())
    out = tmp_path / "out.txt"
    with open(out, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "kvexp", "validate", *map(str, files)], stdout=sink,
                                stderr=subprocess.PIPE, text=True, env={**this_tree(), "PYTHONUNBUFFERED": "1"},
                                start_new_session=True)
        if after_s is None:
            wait_until(lambda: ": valid" in out.read_text(), proc, "a first file validated")
        else:
            time.sleep(after_s)
        os.killpg(proc.pid, sig)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err
    assert err in (f"kvexp: interrupted by {sig.name}\n", f"kvexp validate: interrupted by {sig.name}\n"), err


@pytest.mark.parametrize("argv", [["report", "--no-such-flag"], ["--help"], ["validate", "--help"]])
def test_a_signal_while_a_usage_error_or_help_exits_is_ignored(argv):
    """argparse ends a usage error or --help with SystemExit: that exit is kvexp's like any other command's,
    so a signal in it does nothing (it used to kill kvexp silently with SIGINT's status, or print a
    traceback). The signal is sent at interpreter exit, after the command has printed everything."""
    code = ("import atexit, os, runpy, signal, sys\n"
            "atexit.register(lambda: os.kill(os.getpid(), signal.SIGINT))\n"
            f"sys.argv = ['kvexp', *{argv!r}]\n"
            "runpy.run_module('kvexp', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=this_tree(), timeout=120)
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    if "--help" in argv:
        assert (proc.returncode, proc.stderr) == (0, ""), proc
        assert "usage" in proc.stdout.lower()
    else:
        assert proc.returncode == 1, proc
        assert proc.stderr.startswith("kvexp report: ") and proc.stderr.count("\n") == 1, proc.stderr


def test_a_signal_that_code_swallows_still_ends_the_command(tmp_path, monkeypatch, capsys):
    """A signal's exception raised inside code that catches everything (aiohttp's response parser hands it
    to one response as a payload error; a garbage-collector callback only prints it) used to be lost: the
    run went on to exit 0. On an event loop it is raised by the loop itself; elsewhere the command's end
    checks for it."""
    import asyncio

    from kvexp.backends import process

    async def swallowing() -> str:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)  # the handler runs here
        except BaseException:  # noqa: BLE001 (the swallowing code this test stands for)
            pass
        await asyncio.sleep(2)
        return "went on"

    handlers = process.raise_on_signals()
    try:
        with pytest.raises(process.Interrupted, match="SIGTERM"):
            asyncio.run(swallowing())
    finally:
        process.restore_signals(handlers)

    def validate_swallowing(argv: list[str]) -> int:
        try:
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.5)
        except BaseException:  # noqa: BLE001
            pass
        return 0

    monkeypatch.setitem(cli.SUBCOMMANDS, "validate", validate_swallowing)
    assert main(["validate", str(tmp_path)]) == 129
    assert capsys.readouterr().err == "kvexp validate: interrupted by SIGHUP\n"


def test_a_signal_landing_in_a_finalizer_is_not_printed(monkeypatch):
    """Python prints an exception a finalizer or garbage-collector callback raises (through
    sys.unraisablehook), traceback and all; a signal's Interrupted landing there is left to the command's
    next checkpoint, quietly. Any other such exception is still handed on."""
    import gc

    from kvexp.backends import process

    class Finalized:
        def __init__(self, exc: BaseException):
            self.exc = exc

        def __del__(self):
            raise self.exc

    printed: list[BaseException] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: printed.append(u.exc_value))
    handlers = process.raise_on_signals()
    try:
        Finalized(process.Interrupted("SIGTERM"))
        Finalized(ValueError("a bug"))
        gc.collect()
    finally:
        process.restore_signals(handlers)
    assert [type(e) for e in printed] == [ValueError]


def test_a_signal_a_finalizer_swallowed_ends_the_command_at_once():
    """A SIGTERM whose Interrupted lands in a finalizer (Python cannot raise it there) is raised again in
    the main thread at its next instruction: the work after the collection never finishes. It used to
    wait for the command's next checkpoint (seconds later during a report)."""
    import gc

    from kvexp.backends import process

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs here, inside the finalizer
                pass

    handlers = process.raise_on_signals()
    steps = 0
    try:
        with pytest.raises(process.Interrupted, match="SIGTERM"):
            Finalized()
            gc.collect()
            for steps in range(1, 10_000_001):
                pass
    finally:
        process.restore_signals(handlers)
    assert steps < 10_000_000
    # the command is over: the next one in this process (here a run_job, whose checkpoints look for a
    # signal) starts with none; it used to find this SIGTERM and end at its first checkpoint
    process.raise_if_interrupted()
