"""Model architecture from config.json and GGUF headers, merged with presets, with sources."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from kvexp.capacity import modelinfo
from kvexp.core.config import ModelConfig
from kvexp import backends
from kvexp.capacity.planner import GIB_BYTES, plan_job

VLLM = backends.REGISTRY["vllm"].cache_model
LLAMACPP = backends.REGISTRY["llamacpp"].cache_model

QWEN25_7B_AWQ_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
    "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
    "tie_word_embeddings": False, "torch_dtype": "float16",
    "quantization_config": {"bits": 4, "group_size": 128, "quant_method": "awq", "version": "gemm",
                            "zero_point": True},
}


def _sparse(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)


def test_hf_config_dir_with_weights_on_disk(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_7B_AWQ_CONFIG))
    _sparse(tmp_path / "model-00001-of-00002.safetensors", 3 * GIB_BYTES)
    _sparse(tmp_path / "model-00002-of-00002.safetensors", GIB_BYTES // 2)
    _sparse(tmp_path / "pytorch_model.bin", 99 * GIB_BYTES)  # ignored: safetensors win
    arch = modelinfo.arch_from(ModelConfig(name="custom"), tmp_path)
    assert (arch.n_layers, arch.n_kv_heads, arch.head_dim) == (28, 4, 128)
    assert arch.dtype_bytes == 2 and arch.weight_bits == 4.0
    assert arch.weights_gib == 3.5
    assert arch.context_length_tokens == 32768
    assert arch.params_b == pytest.approx(7.62, abs=0.01)  # estimated from the layer shapes
    assert arch.sources["n_layers"] == "config.json"
    assert arch.sources["head_dim"] == "config.json (hidden_size / num_attention_heads)"
    assert arch.sources["weights_gib"] == "files on disk"
    assert arch.sources["weight_bits"] == "config.json quantization_config"

    plan = plan_job(arch, "auto", VLLM, 16.0, prompt_tokens=4096, max_tokens=256, levels=[32, 48])
    # By hand: 2 x 28 x 4 x 128 x 2 = 57344 bytes/token;
    # free = 16 x 0.9 - 3.5 - 1.5 = 9.4 GiB = 10093173145.6 bytes -> 176010.97 tokens -> 176010;
    # whole blocks of 16: 11000 blocks = 176000 tokens; 11000 // 272 = 40 requests of 4352 tokens.
    assert plan["kv_bytes_per_token"] == 57344
    assert math.floor(9.4 * GIB_BYTES / 57344) == 176010
    assert plan["capacity_tokens"] == 176000 and plan["blocks"] == 11000
    assert plan["max_concurrency_before_preemption"] == 40
    assert [lv["predicts_preemption"] for lv in plan["levels"]] == [False, True]
    assert plan["sources"]["weights_gib"] == "files on disk"


def test_hf_config_defaults_and_nesting():
    # no num_key_value_heads: every head has its own K/V; explicit head_dim wins over hidden/heads
    values, sources = modelinfo.hf_config_fields({
        "text_config": {"num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 512,
                        "head_dim": 96, "torch_dtype": "bfloat16"},
        "num_hidden_layers": 99})
    assert values["n_layers"] == 4 and values["n_kv_heads"] == 8 and values["head_dim"] == 96
    assert values["dtype_bytes"] == 2 and values["weight_bits"] == 16
    assert sources["n_kv_heads"].startswith("config.json (num_attention_heads")
    v2, _ = modelinfo.hf_config_fields({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
                                        "dtype": "float32", "quantization_config": {"quant_method": "fp8"}})
    assert v2["head_dim"] == 16 and v2["dtype_bytes"] == 4 and v2["weight_bits"] == 8.0


def _write_gguf(path: Path, *, n_layers=2, n_embd=64, n_head=4, n_head_kv=2, n_vocab=32,
                key_length=None, value_length=None) -> int:
    """A tiny llama GGUF with F16 tensors; returns the number of parameters written."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(2048)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(2 * n_embd)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    if key_length is not None:
        w.add_key_length(key_length)
        w.add_value_length(value_length)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    head_dim = n_embd // n_head
    n = 0

    def t(name: str, *shape: int) -> None:
        nonlocal n
        w.add_tensor(name, np.zeros(shape, dtype=np.float16))
        n += int(np.prod(shape))

    t("token_embd.weight", n_vocab, n_embd)
    for i in range(n_layers):
        t(f"blk.{i}.attn_q.weight", n_head * head_dim, n_embd)
        t(f"blk.{i}.attn_k.weight", n_head_kv * head_dim, n_embd)
        t(f"blk.{i}.attn_v.weight", n_head_kv * head_dim, n_embd)
        t(f"blk.{i}.attn_output.weight", n_embd, n_head * head_dim)
    t("output.weight", n_vocab, n_embd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return n


def test_gguf_header_and_hand_computed_plan(tmp_path):
    path = tmp_path / "tiny.gguf"
    n_params = _write_gguf(path)
    arch = modelinfo.arch_from(ModelConfig(name="tiny-test", gguf=str(path)), path)
    # head_dim = embedding_length / head_count = 64 / 4 = 16
    assert (arch.n_layers, arch.n_kv_heads, arch.head_dim) == (2, 2, 16)
    assert arch.context_length_tokens == 2048
    assert n_params == 2 * 32 * 64 + 2 * (64 * 64 + 2 * 32 * 64 + 64 * 64) == 28672
    assert arch.params_b == round(n_params / 1e9, 4)
    assert arch.weight_bits == 16.0  # F16 tensors
    assert arch.weights_gib == path.stat().st_size / GIB_BYTES
    assert arch.sources["n_layers"] == "gguf header"
    assert arch.sources["head_dim"] == "gguf header (embedding_length / head_count)"
    assert arch.sources["weights_gib"] == "files on disk"
    assert arch.sources["file_type"] == "MOSTLY_F16"

    plan = plan_job(arch, "q8_0", LLAMACPP, None, prompt_tokens=300, max_tokens=100, levels=[1, 2, 4],
                    context=1024, parallel=2)
    # By hand: 2 (K,V) x 2 layers x 2 KV heads x 16 x 34/32 bytes = 136 bytes per token;
    # -c 1024 -> 1024 x 136 = 139264 bytes; 2 slots of 512 cells; a 400-token request fits a slot.
    assert plan["kv_bytes_per_token"] == 136
    assert plan["kv_cache_bytes"] == 139264
    assert plan["context_per_slot_tokens"] == 512
    assert plan["max_concurrent_requests"] == 2
    assert [lv["predicted_kv_usage"] for lv in plan["levels"]] == [round(400 / 1024, 4), round(800 / 1024, 4),
                                                                   round(800 / 1024, 4)]
    # without a context: llama-server -c 0 takes the model's 2048
    assert plan_job(arch, "f16", LLAMACPP, None, prompt_tokens=1, max_tokens=1, levels=[])["capacity_tokens"] == 2048


def test_gguf_key_and_value_lengths(tmp_path):
    path = tmp_path / "kv.gguf"
    _write_gguf(path, key_length=24, value_length=8)
    arch = modelinfo.arch_from(ModelConfig(name="kv"), path)
    # K 24 + V 8 per head: (24 + 8) / 2 = 16 keeps 2 x layers x heads x head_dim exact
    assert arch.head_dim == 16
    assert "key_length + value_length" in arch.sources["head_dim"]


def test_preset_is_the_fallback_and_can_override(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_7B_AWQ_CONFIG))
    preset = ModelConfig(name="qwen2.5-7b", n_layers=30, n_kv_heads=4, head_dim=128, params_b=7.62,
                         weights_gib=5.188)
    arch = modelinfo.arch_from(preset, tmp_path)
    assert arch.n_layers == 28 and arch.sources["n_layers"] == "config.json (preset said 30)"
    assert arch.weights_gib == 5.188 and arch.sources["weights_gib"] == "preset"  # no weight files
    forced = modelinfo.arch_from(preset, tmp_path, prefer_preset=True)
    assert forced.n_layers == 30 and forced.sources["n_layers"] == "preset (files say 28)"

    only_preset = modelinfo.arch_from(preset, None)
    assert (only_preset.n_layers, only_preset.weights_gib) == (30, 5.188)
    assert set(only_preset.sources.values()) == {"preset"}


def test_weights_estimate_and_builtin_table():
    arch = modelinfo.arch_from(ModelConfig(name="x", n_layers=2, n_kv_heads=2, head_dim=64, params_b=8.0,
                                           weight_bits=4.5), None)
    assert arch.weights_gib == pytest.approx(8e9 * 4.5 / 8 / GIB_BYTES)
    assert arch.sources["weights_gib"].startswith("estimate: params_b x 4.5 bits")
    bare = modelinfo.arch_from(ModelConfig(name="qwen3-8b"), None)
    assert (bare.n_layers, bare.n_kv_heads, bare.head_dim, bare.params_b) == (36, 8, 128, 8.19)
    assert bare.sources["n_layers"] == "planner preset table"
    assert bare.weights_gib == pytest.approx(8.19e9 * 2 / GIB_BYTES)  # 16-bit assumed
    nothing = modelinfo.arch_from(ModelConfig(name="unknown"), None)
    assert nothing.n_layers is None and nothing.weights_gib is None
    plan = plan_job(nothing, "fp16", VLLM, 15.92, prompt_tokens=1, max_tokens=1, levels=[1])
    assert plan["kv_bytes_per_token"] is None and plan["capacity_tokens"] is None


def test_model_files_per_backend(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snap = tmp_path / "hub" / "models--Org--M" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(QWEN25_7B_AWQ_CONFIG))
    (tmp_path / "hub" / "models--Org--M" / "refs").mkdir()
    (tmp_path / "hub" / "models--Org--M" / "refs" / "main").write_text("abc123")
    gguf_path = tmp_path / "m.gguf"
    _write_gguf(gguf_path)
    model = ModelConfig(name="m", hf="Org/M", gguf=str(gguf_path), ollama="m:latest")
    assert modelinfo.model_files(model, "hf") == snap
    assert modelinfo.model_files(model, "gguf") == gguf_path
    assert modelinfo.model_files(model, "ollama") is None
    assert modelinfo.arch_for(model, "hf").n_layers == 28
    assert modelinfo.arch_for(model, "gguf").n_layers == 2
    assert modelinfo.model_files(ModelConfig(name="m", hf="Org/Absent"), "hf") is None


def test_split_gguf_weights_count_every_shard(tmp_path):
    for i in (1, 2, 3):
        _sparse(tmp_path / f"big-{i:05d}-of-00003.gguf", i * 1000)
    assert modelinfo.weights_bytes_on_disk(tmp_path / "big-00001-of-00003.gguf") == 6000


def test_a_gguf_header_of_arrays_nested_deep_is_refused_as_corrupt(tmp_path):
    """20,000 arrays each holding the next: one line naming the file (it used to be a RecursionError)."""
    import struct

    from kvexp.capacity import gguffile

    key = b"general.x"
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", 9)
    nested = struct.pack("<IQ", 9, 1) * 20_000 + struct.pack("<IQ", 4, 1) + struct.pack("<I", 7)
    path = tmp_path / "nested.gguf"
    path.write_bytes(head + nested)
    with pytest.raises(gguffile.GGUFError) as e:
        gguffile.read_header(path)
    assert str(e.value) == f"{path}: the GGUF header nests arrays more than 8 deep: a corrupt file"
