"""Whether this machine can run CUDA builds, and which build an install makes.

An NVIDIA GPU is usable when its driver is there (any of: `nvidia-smi` on PATH, the NVML library
`libnvidia-ml.so.1` loadable, `/proc/driver/nvidia/version`). Building llama.cpp's CUDA kernels also
needs the CUDA compiler (`nvcc`, on PATH or under CUDA_HOME / /usr/local/cuda); vLLM's CUDA wheels bring
their own CUDA runtime, so the driver is enough there. `probe()` does the I/O; `choose()` is pure, so
the choice is tested with any probe."""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

DRIVER_PROC = Path("/proc/driver/nvidia/version")
NVML_LIB = "libnvidia-ml.so.1"
CUDART_LIBS = ("libcudart.so", "libcudart.so.12", "libcudart.so.13", "libcudart.so.11.0")
BUILDS = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class CudaProbe:
    """What was found of an NVIDIA GPU's software (None: not found), and where kvexp looked."""

    driver: Optional[str] = None  # how the driver was found ("nvidia-smi at /usr/bin/nvidia-smi", ...)
    nvcc: Optional[str] = None  # the CUDA compiler's path
    runtime: Optional[str] = None  # a CUDA runtime library that loads (libcudart)
    gpus: tuple[str, ...] = field(default=())  # names nvidia-smi lists

    @property
    def toolkit(self) -> Optional[str]:
        """nvcc, else the CUDA runtime (what runs CUDA code besides the driver)."""
        return f"nvcc at {self.nvcc}" if self.nvcc else self.runtime


@dataclass(frozen=True)
class Choice:
    """The build an install makes ("cpu" or "cuda") and, in one clause, why."""

    build: str
    reason: str


class NoCuda(Exception):
    """--cuda where the CUDA build cannot be made or run; the message is one line naming what is missing."""


NO_DRIVER = "no NVIDIA driver found: no nvidia-smi on PATH, no libnvidia-ml.so.1, no /proc/driver/nvidia"


def _loads(name: str) -> bool:
    try:
        ctypes.CDLL(name)
        return True
    except OSError:
        return False


def find_nvcc() -> Optional[str]:
    """nvcc on PATH, else under $CUDA_HOME/bin, $CUDA_PATH/bin or /usr/local/cuda/bin."""
    if w := shutil.which("nvcc"):
        return w
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


def _gpu_names(smi: str) -> tuple[str, ...]:
    try:
        out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(line.strip() for line in out.stdout.splitlines() if line.strip()) if out.returncode == 0 else ()


def probe() -> CudaProbe:
    """Look for the driver, nvcc and the CUDA runtime on this machine (milliseconds; nvidia-smi is
    asked for the GPUs' names when it is there)."""
    driver, gpus = None, ()
    smi = shutil.which("nvidia-smi")
    if smi:
        driver, gpus = f"nvidia-smi at {smi}", _gpu_names(smi)
    elif _loads(NVML_LIB):
        driver = NVML_LIB
    elif DRIVER_PROC.is_file():
        driver = str(DRIVER_PROC)
    runtime = next((lib for lib in CUDART_LIBS if _loads(lib)), None)
    return CudaProbe(driver=driver, nvcc=find_nvcc(), runtime=runtime, gpus=gpus)


@functools.lru_cache(maxsize=1)
def gpu_present() -> bool:
    """Whether an NVIDIA driver is here (a launched server then gets the GPU defaults: every layer
    offloaded). Cached for the process."""
    return probe().driver is not None


def _gpu_words(p: CudaProbe) -> str:
    return f"{', '.join(p.gpus)}; driver: {p.driver}" if p.gpus else f"driver: {p.driver}"


def choose(asked: str, server: str, p: CudaProbe) -> Choice:
    """The build of `server` ("llamacpp" compiles CUDA kernels and needs nvcc; "vllm" installs CUDA wheels
    that bring their own runtime) that `asked` ("auto", "cpu", "cuda") makes on a machine probed as p.
    --cuda where it cannot be made raises NoCuda naming what is missing."""
    if asked not in BUILDS:
        raise ValueError(f"build {asked!r}: allowed values are {', '.join(BUILDS)}")
    compiles = server == "llamacpp"
    if asked == "cpu":
        return Choice("cpu", "--cpu")
    if p.driver is None:
        if asked == "cuda":
            raise NoCuda(f"--cuda: {NO_DRIVER}; install the NVIDIA driver, or drop --cuda for the CPU build")
        return Choice("cpu", f"{NO_DRIVER}; --cuda forces the CUDA build")
    if compiles and p.nvcc is None:
        missing = ("no nvcc (the CUDA toolkit's compiler: not on PATH, CUDA_HOME or /usr/local/cuda) to compile "
                   "llama.cpp's CUDA kernels")
        if asked == "cuda":
            raise NoCuda(f"--cuda: an NVIDIA driver is here ({p.driver}) but {missing}; install the CUDA toolkit")
        return Choice("cpu", f"an NVIDIA GPU is here ({_gpu_words(p)}) but {missing}; install the CUDA toolkit and "
                             "run install --cuda --force")
    how = f"nvcc at {p.nvcc}" if compiles else "the CUDA runtime comes with vLLM's wheels"
    return Choice("cuda", ("--cuda" if asked == "cuda" else "an NVIDIA GPU is here") + f" ({_gpu_words(p)}; {how})")
