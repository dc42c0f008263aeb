"""Shared fixtures: the real llama-server (built once by `python -m kvexp install llamacpp`) and the
tiny GGUF kvexp writes itself."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT.parent / "shared" / "reference" / "rtx5070ti-qwen2.5-7b.json"
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="session")
def reference_path() -> Path:
    local = FIXTURES / "rtx5070ti-qwen2.5-7b.json"
    return local if local.is_file() else REFERENCE


@pytest.fixture(scope="session")
def llama_server() -> Path:
    from kvexp.assets.install import find_llama_server

    found = find_llama_server()
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("llama-server is missing in CI: .ci/run must run `python -m kvexp install llamacpp`")
        pytest.skip("llama-server not installed: run `python -m kvexp install llamacpp`")
    return found


@pytest.fixture(scope="session")
def ollama() -> Path:
    from kvexp.assets.install import find_ollama

    found = find_ollama()
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("ollama is missing in CI: .ci/run must run `python -m kvexp install ollama`")
        pytest.skip("ollama not installed: run `python -m kvexp install ollama`")
    return found


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


def pgrep(pattern: str) -> list[str]:
    if not shutil.which("pgrep"):
        return []
    out = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if "pgrep" not in ln and "pytest" not in ln]


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
    return [*args[:flags], *TINY, *args[flags:]]


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
