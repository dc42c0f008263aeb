"""Every YAML in every group composes; every bad config stops at start with one line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import TINY

from kvexp.app.compose import _options, check, compose, compose_all, kv_choices
from kvexp.backends import REGISTRY as BACKENDS
from kvexp.backends.llamacpp import LlamaCppConfig
from kvexp.backends.ollama import OllamaConfig
from kvexp.backends.vllm import VLLMConfig
from kvexp.core.config import ConfigError
from kvexp.capacity.planner import kv_bytes_per_element

GROUP_DEFAULTS = {"backend": "llamacpp", "kv": "fp16"}


@pytest.mark.parametrize("group", ["backend", "model", "kv", "scenario", "gpu"])
def test_every_option_composes(group):
    options = _options(group)
    assert options, f"conf/{group}/ has no options"
    for opt in options:
        overrides = [f"{group}={opt}"]
        if group == "kv":  # pick a backend that can use this dtype
            backend = next(b for b in BACKENDS if b in kv_choices()[opt].per_backend)
            overrides.append(f"backend={backend}")
        cfg = compose(overrides)
        if group != "gpu":  # gpu presets are named by their GPU, not their file
            assert getattr(cfg, group).name == opt


def test_backend_schemas_are_typed():
    assert isinstance(compose([*TINY, "backend=llamacpp"]).backend, LlamaCppConfig)
    assert isinstance(compose([*TINY, "backend=vllm"]).backend, VLLMConfig)
    assert isinstance(compose([*TINY, "backend=ollama", "kv=q8_0"]).backend, OllamaConfig)


def test_default_is_the_embedded_cpu_job():
    cfg = compose(TINY)
    assert (cfg.backend.name, cfg.model.name, cfg.kv.name, cfg.scenario.name) == ("llamacpp", "tiny", "fp16", "smoke")
    assert cfg.model.gguf == "@tiny"


def test_sweep_expands_to_every_combination():
    jobs = compose_all(["backend=vllm,llamacpp", "kv=fp16,fp8"])
    assert [(c.backend.name, c.kv.name) for _, c in jobs] == [
        ("vllm", "fp16"), ("vllm", "fp8"), ("llamacpp", "fp16"), ("llamacpp", "fp8")]


def test_reference_scenarios():
    chat, long = compose([*TINY, "scenario=chat"]).scenario, compose([*TINY, "scenario=long"]).scenario
    assert (chat.prompt_tokens, chat.max_tokens, chat.concurrency, chat.requests) == (512, 256, [1, 4, 16], 48)
    assert (long.prompt_tokens, long.max_tokens, long.concurrency, long.requests) == (4096, 256, [8, 16, 32, 48], 144)


def test_kv_names_map_per_backend():
    kvs = kv_choices()
    assert kvs["fp16"].per_backend == {"llamacpp": "f16", "vllm": "float16", "ollama": "f16"}
    assert kvs["bf16"].per_backend == {"llamacpp": "bf16", "vllm": "bfloat16"}
    assert kvs["fp8"].per_backend == {"vllm": "fp8"}
    assert kv_bytes_per_element(kvs["q8_0"].per_backend["llamacpp"]) == pytest.approx(34 / 32)
    assert kv_bytes_per_element(kvs["q4_0"].per_backend["llamacpp"]) == pytest.approx(18 / 32)


def test_unsupported_pair_can_be_skipped_instead():
    cfg = compose([*TINY, "kv=fp8", "unsupported=skip"])
    assert check(cfg, kv_choices()).startswith("kv=fp8 is not available on backend=llamacpp")
    with pytest.raises(ConfigError):
        check(compose([*TINY, "kv=fp8"]), kv_choices())


BAD = [
    (["kv=fp7"], "kv=fp7: no such option; allowed values are bf16, fp16, fp8, iq4_nl, q4_0, q4_1, q5_0, q5_1, q8_0 (or a K/V pair <K>/<V> of two of them for llama.cpp, e.g. q8_0/q4_0)"),
    (["scenario.concurrency=[1,x]"], "scenario.concurrency[1]: Value 'x' of type 'str' could not be converted to Integer"),
    (["scenario.concurrency=four"], "scenario.concurrency"),
    (["scenario.foo=1"], "scenario.foo: unknown key; allowed keys are api, arrival"),
    (["backend.bogus=3"], "backend.bogus: unknown key"),
    (["kv=fp8"], "kv=fp8 is not available on backend=llamacpp (allowed for llamacpp: bf16, fp16, iq4_nl, q4_0, q4_1, q5_0, q5_1, q8_0)"),
    (["backend=ollama", "kv=bf16"], "kv=bf16 is not available on backend=ollama (allowed for ollama: fp16, q4_0, q8_0)"),
    (["backend=vllm", "kv=q8_0"], "kv=q8_0 is not available on backend=vllm (allowed for vllm: bf16, fp16, fp8)"),
    (["model=nope"], "model=nope: no such option; allowed values are"),
    (["scenario.requests=abc"], "scenario.requests: Value 'abc'"),
    (["scenario.concurrency=[0]"], "scenario.concurrency=[0]: every level must be an integer >= 1"),
    (["scenario.api=grpc"], "scenario.api='grpc': allowed values are completions, chat"),
    (["unsupported=maybe"], "unsupported='maybe': allowed values are auto, error, skip"),
    (["scenario.max_tokens=0"], "scenario.max_tokens=0: must be >= 1"),
    (["scenario.concurrency=[]"], "scenario smoke: give scenario.concurrency"),
]


@pytest.mark.parametrize("overrides,expected", BAD)
def test_bad_config_is_one_line(overrides, expected):
    with pytest.raises(ConfigError) as e:
        for _, cfg in compose_all([*TINY, *overrides]):
            check(cfg, kv_choices())
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(expected), msg


def test_bad_config_from_the_command_line_exits_1_with_one_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "kvexp", *TINY, "kv=fp7"], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 1
    assert p.stderr.strip() == "kvexp: kv=fp7: no such option; allowed values are bf16, fp16, fp8, iq4_nl, q4_0, q4_1, q5_0, q5_1, q8_0 (or a K/V pair <K>/<V> of two of them for llama.cpp, e.g. q8_0/q4_0)"
    assert not (tmp_path / "outputs").exists()
