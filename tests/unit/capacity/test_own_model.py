"""Your model, named once: `model.gguf=PATH` or `model.hf=DIR` alone is a model of its own (model=own),
its architecture read from the file and recorded with its source; a preset the file contradicts is
refused in one line; a hub id not in the local cache is said before the run, or refused with
model.allow_download=false."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvexp.app import preflight
from kvexp.app.compose import compose_all, hydra_argv, kv_choices, check, own_model, own_model_name
from kvexp.assets.tinymodels import write_tiny_gguf
from kvexp.backends import adapter_class
from kvexp.capacity import modelinfo
from kvexp.core.config import ConfigError

LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
                "intermediate_size": 512, "num_hidden_layers": 6, "num_attention_heads": 4,
                "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 4096,
                "torch_dtype": "bfloat16", "tie_word_embeddings": True}


@pytest.fixture
def own_gguf(tmp_path) -> Path:
    return write_tiny_gguf(tmp_path / "My-Model-Q8_0.gguf", n_layers=3, n_embd=64, n_head=2, n_head_kv=1)


@pytest.fixture
def hf_dir(tmp_path) -> Path:
    d = tmp_path / "my-llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    return d


def _one(overrides):
    jobs = compose_all(overrides)
    assert len(jobs) == 1
    return jobs[0][1]


def test_a_model_file_alone_picks_the_own_model():
    assert own_model(["model.gguf=/m/x.gguf", "kv=q8_0"]) == ["model=own", "model.gguf=/m/x.gguf", "kv=q8_0"]
    assert own_model(["backend=vllm", "model.hf=/m/dir"])[0] == "model=own"
    assert own_model(["model=qwen2.5-7b", "model.gguf=/m/x.gguf"]) == ["model=qwen2.5-7b", "model.gguf=/m/x.gguf"]
    assert own_model(["kv=q8_0"]) == ["kv=q8_0"]
    assert hydra_argv(["-m", "model.gguf=/a.gguf,/b.gguf"]) == ["-m", "model=own", "model.gguf=/a.gguf,/b.gguf"]


def test_the_own_models_name_is_the_files():
    assert own_model_name("/models/Qwen2.5-7B-Instruct-Q4_K_M.gguf", None) == "Qwen2.5-7B-Instruct-Q4_K_M"
    assert own_model_name("/m/Llama-3.3-70B-Q4_K_M-00001-of-00002.gguf", None) == "Llama-3.3-70B-Q4_K_M"
    assert own_model_name(None, "/models/my-llama/") == "my-llama"
    assert own_model_name(None, "Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"  # vLLM's own name for it
    assert own_model_name(None, "/root/.cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/abc123") == "Qwen3-8B"
    assert own_model_name(None, None) == "own"


def test_a_gguf_alone_needs_no_other_model_key_and_its_architecture_comes_from_its_header(own_gguf):
    cfg = _one([f"model.gguf={own_gguf}", "scenario=smoke"])
    assert cfg.model.name == "My-Model-Q8_0" and cfg.model.hf is None and cfg.model.n_layers is None
    assert check(cfg, kv_choices()) is None
    preflight.check_model_file(cfg)
    arch = modelinfo.arch_for(cfg.model, "gguf")
    assert (arch.n_layers, arch.n_kv_heads, arch.head_dim) == (3, 1, 32)
    recorded = modelinfo.architecture_of(arch)
    assert recorded["n_layers"] == 3 and recorded["sources"]["n_layers"] == "gguf header"
    assert recorded["sources"]["head_dim"].startswith("gguf header") and recorded["sources"]["weights_gib"] == "files on disk"


def test_an_hf_folder_alone_needs_no_other_model_key_and_its_architecture_comes_from_config_json(hf_dir):
    cfg = _one(["backend=vllm", f"model.hf={hf_dir}", "scenario=cpu"])
    assert cfg.model.name == "my-llama" and cfg.model.gguf is None
    assert check(cfg, kv_choices()) is None
    preflight.check_model_file(cfg)
    arch = modelinfo.arch_for(cfg.model, adapter_class("vllm").model_field)
    recorded = modelinfo.architecture_of(arch)
    assert (recorded["n_layers"], recorded["n_kv_heads"], recorded["head_dim"]) == (6, 2, 64)
    assert recorded["sources"]["n_layers"] == "config.json"
    assert recorded["sources"]["head_dim"] == "config.json (hidden_size / num_attention_heads)"
    assert recorded["context_length_tokens"] == 4096


def test_a_preset_the_file_contradicts_is_refused_in_one_line(own_gguf):
    cfg = _one(["model=qwen2.5-7b", f"model.gguf={own_gguf}", "scenario=smoke"])
    with pytest.raises(ConfigError) as e:
        preflight.check_model_file(cfg)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("model=qwen2.5-7b gives n_layers=28 (and n_kv_heads, head_dim), but ")
    assert f"{own_gguf} says 3 (gguf header): that file is another model" in msg
    agree = _one(["model=qwen2.5-7b", f"model.gguf={own_gguf}", "model.n_layers=3", "model.n_kv_heads=1",
                  "model.head_dim=32"])
    preflight.check_model_file(agree)  # numbers that agree with the file are no conflict


def test_a_hub_id_not_in_the_cache_is_said_before_the_run_or_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    jobs = compose_all(["backend=vllm", "model=qwen2.5-7b", "scenario=chat"])
    notes = preflight.download_notes(jobs)
    assert len(notes) == 1 and notes[0].startswith(
        f"model.hf=Qwen/Qwen2.5-7B-Instruct-AWQ is not in the local Hugging Face cache ({tmp_path / 'hub'}): "
        "the server downloads it when it starts, about 5.2 GiB of weights")
    assert "HF_TOKEN" in notes[0] and "model.allow_download=false" in notes[0]
    from kvexp.backends.vllm import VLLM

    spec = VLLM(jobs[0][1], "/usr/bin/python3", "Qwen/Qwen2.5-7B-Instruct-AWQ").spec
    assert "HF_HUB_OFFLINE" not in dict(spec.env) and "model_download" in dict(spec.sources)
    refused = _one(["backend=vllm", "model=qwen2.5-7b", "scenario=chat", "model.allow_download=false"])
    with pytest.raises(ConfigError, match=r"^model.hf=Qwen/Qwen2.5-7B-Instruct-AWQ: not in the local Hugging Face "
                                          r"cache .*model.allow_download=false refuses"):
        preflight.check_model_file(refused)
    assert preflight.download_notes([([], refused)]) == []
    # in the cache: offline as before, nothing said
    snap = tmp_path / "hub" / "models--Qwen--Qwen2.5-7B-Instruct-AWQ" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    assert preflight.download_notes(jobs) == []
    assert dict(VLLM(jobs[0][1], "/usr/bin/python3", "x").spec.env)["HF_HUB_OFFLINE"] == "1"
