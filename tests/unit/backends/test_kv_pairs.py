"""K and V caches apart: kv=<K>/<V> (llama.cpp's -ctk/-ctv), refused in one line where a backend sets one type
for both (Ollama's OLLAMA_KV_CACHE_TYPE, vLLM's --kv-cache-dtype), with labels, config hash, planner bytes
(K and V each at its own type), llama-perplexity's flags and the flash-attention rule for a quantised V."""

from __future__ import annotations

import pytest
from conftest import TINY

from kvexp.app.checks import check_config as check
from kvexp.app.compose import compose
from kvexp.backends.llamacpp import LlamaCpp, exact_kv_bytes
from kvexp.capacity.planner import kv_bytes_per_element, kv_bytes_per_token, kv_pair
from kvexp.core.config import ConfigError, check_kv, job_label, to_plain
from kvexp.quality.perplexity import perplexity_argv
from kvexp.results.validate import config_hash


def test_a_pair_launches_llama_server_with_its_own_k_and_v_types():
    cfg = compose([*TINY, "kv=q8_0/q4_0"])
    check(cfg)
    assert cfg.kv.name == "q8_0/q4_0" and cfg.kv.per_backend == {"llamacpp": "q8_0/q4_0"}
    argv = LlamaCpp(cfg, "/m.gguf", "/bin/llama-server").launch_argv(1234)
    assert argv[argv.index("-ctk") + 1] == "q8_0" and argv[argv.index("-ctv") + 1] == "q4_0"
    assert job_label(cfg) == "llamacpp-tiny-kq8_0-vq4_0-smoke"
    single = compose([*TINY, "kv=q8_0"])
    assert config_hash(to_plain(cfg)) != config_hash(to_plain(single))
    fp16_v = compose([*TINY, "kv=q8_0/fp16"])
    argv = LlamaCpp(fp16_v, "/m.gguf", "/bin/llama-server").launch_argv(1234)
    assert argv[argv.index("-ctv") + 1] == "f16"


@pytest.mark.parametrize("kv", ["q4_1", "q5_0", "q5_1", "iq4_nl", "q5_1/iq4_nl"])
def test_llama_cpps_other_cache_types_compose_and_plan(kv):
    cfg = compose([*TINY, f"kv={kv}"])
    check(cfg)
    k, v = kv_pair(cfg.kv.per_backend["llamacpp"])
    assert kv_bytes_per_element(cfg.kv.per_backend["llamacpp"]) == pytest.approx(
        (kv_bytes_per_element(k) + kv_bytes_per_element(v)) / 2)


def test_planner_bytes_size_k_and_v_each_at_its_own_type():
    # SmolLM2-135M: 30 layers, 3 KV heads of 64: K at q8_0 (34 bytes per 32) and V at q4_0 (18 per 32)
    per_layer_k, per_layer_v = 3 * 64 * 34 / 32, 3 * 64 * 18 / 32
    assert kv_bytes_per_token(30, 3, 64, kv_bytes_per_element("q8_0/q4_0")) == pytest.approx(
        30 * (per_layer_k + per_layer_v)) == 9360
    # the server's own cache bytes from its log's cells: the same sizes
    assert exact_kv_bytes(1024, 30, 3 * 64, "q8_0", "q4_0") == 1024 * 9360


@pytest.mark.parametrize("backend", ["ollama", "vllm"])
def test_a_pair_is_refused_in_one_line_where_one_type_serves_k_and_v(backend):
    cfg = compose([f"backend={backend}", "kv=q8_0/q4_0", "scenario=smoke"])
    with pytest.raises(ConfigError) as e:
        check_kv(backend, cfg.kv)
    assert str(e.value).startswith(f"kv=q8_0/q4_0: a K/V pair is not available on backend={backend}, which sets "
                                   "one KV cache type for K and V together")
    assert "\n" not in str(e.value)


def test_a_quantised_v_without_flash_attention_is_refused_before_launch_a_quantised_k_is_not():
    with pytest.raises(ConfigError, match=r"-ctv q4_0\) with backend.flash_attn=off: llama-server refuses a "
                                          r"quantised V cache without flash attention"):
        LlamaCpp(compose([*TINY, "kv=q8_0/q4_0", "backend.flash_attn=off"]), "/m.gguf", "/bin/llama-server")
    be = LlamaCpp(compose([*TINY, "kv=q8_0/fp16", "backend.flash_attn=off"]), "/m.gguf", "/bin/llama-server")
    argv = be.launch_argv(1)
    assert argv[argv.index("-fa") + 1] == "off" and argv[argv.index("-ctk") + 1] == "q8_0"


def test_llama_perplexity_gets_the_same_ctk_and_ctv():
    argv = perplexity_argv("lp", "m.gguf", "t.txt", 512, 4, "q8_0/q4_0", "on", 1, None, "base.kld", True)
    assert argv[argv.index("-ctk") + 1] == "q8_0" and argv[argv.index("-ctv") + 1] == "q4_0"
    argv = perplexity_argv("lp", "m.gguf", "t.txt", 512, 4, "q8_0", "on", 1, None, "base.kld", True)
    assert argv[argv.index("-ctk") + 1] == "q8_0" and argv[argv.index("-ctv") + 1] == "q8_0"

