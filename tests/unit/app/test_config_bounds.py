"""Every number of the config is finite and bounded, every count capped, every KV type one the backend
accepts and the dtype the job is labelled with, and no setting is silently ignored: each refused with
one line naming the key and the bound, exit status 1, before any server starts."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from conftest import TINY, hardware_skip, kvexp_main

from kvexp.app import bounds, checks
from kvexp.app.compose import _options, check, compose, compose_all, kv_choices
from kvexp.backends import REGISTRY
from kvexp.core.config import ConfigError

SEARCH = ["scenario.search=concurrency", "scenario.slo_ttft_ms=100"]
RATES = ["scenario.concurrency=[]", "scenario.rates=[1,2]"]
CAP = bounds.max_workers()

# (overrides, the start of the one line after "kvexp: ", text the line must also hold)
REFUSED = [
    # 1. not finite, and bounded
    (["scenario.stall_timeout_s=inf"], "scenario.stall_timeout_s=inf: must be > 0 and <= 86,400 s (a day)", ""),
    (["scenario.request_timeout_s=nan"], "scenario.request_timeout_s=nan: must be > 0 and <= 86,400 s (a day)", ""),
    (["scenario.request_timeout_s=100000"], "scenario.request_timeout_s=100000.0: must be > 0 and <= 86,400 s", ""),
    (["scenario.slo_ttft_ms=inf"], "scenario.slo_ttft_ms=inf: must be > 0 (or null: no TTFT objective) and "
     "<= 86,400,000 ms (a day)", ""),
    (["scenario.slo_tpot_ms=-inf"], "scenario.slo_tpot_ms=-inf: must be > 0 (or null: no TPOT objective) and "
     "<= 86,400,000 ms (a day)", ""),
    (["backend.ready_timeout_s=inf"], "backend.ready_timeout_s=inf: must be > 0 and <= 86,400 s (a day)", ""),
    (["backend.telemetry_interval_s=inf"], "backend.telemetry_interval_s=inf: must be >= 0.001 and <= 60 s", ""),
    (["backend.telemetry_interval_s=0"], "backend.telemetry_interval_s=0.0: must be >= 0.001 and <= 60 s", ""),
    (["model.params_b=inf"], "model.params_b=inf: must be > 0 (or null: read from the model files) and <= 100,000 "
     "(100 trillion parameters)", ""),
    (["model.weights_gib=nan"], "model.weights_gib=nan: must be > 0 (or null: read from the model files) and "
     "<= 1,048,576 (a PiB)", ""),
    (["model.weight_bits=inf"], "model.weight_bits=inf: must be > 0", "<= 64 (bits per parameter)"),
    (["scenario.max_start_rate=inf"], "scenario.max_start_rate=inf: must be > 0 and <= 100,000 requests/s "
     "(or null: no cap)", ""),
    ([*SEARCH, "scenario.search_resolution=inf"], "scenario.search_resolution=inf: must be > 0 and <= 4,096 "
     "(or null: the grid as given)", ""),
    (["scenario.search=rate", "scenario.slo_ttft_ms=100", *RATES, "scenario.search_resolution=nan"],
     "scenario.search_resolution=nan: must be > 0 and <= 100,000 requests/s", ""),
    ([*SEARCH, "scenario.search_min_growth=inf"], "scenario.search_min_growth=inf: must be >= 0 and <= 100", ""),
    (["gpu.sample_interval_s=inf"], "gpu.sample_interval_s=inf: must be >= 0.001 and <= 60", ""),
    (["backend.stop_grace_s=nan"], "backend.stop_grace_s=nan: must be >= 0 and <= 3,600", ""),
    # any other float: the walk over the whole config (search_min_growth is only range-checked with a search)
    (["scenario.search_min_growth=inf"], "scenario.search_min_growth=inf: not a finite number; allowed values are "
     "finite numbers", ""),
    # 2. counts
    (["client.workers=1000"], f"client.workers=1000: allowed values are auto or 1..{CAP} (one worker process per "
     "CPU core kvexp may use", ""),
    (["client.workers=100000000"], f"client.workers=100000000: allowed values are auto or 1..{CAP}", ""),
    (["scenario.requests=100000000"], "scenario.requests=100000000: must be >= 1 and <= 1,000,000", ""),
    (["scenario.repeats=100000"], "scenario.repeats=100000: must be >= 1 and <= 1,000", ""),
    (["scenario.concurrency=[1,100000]"], "scenario.concurrency=[1, 100000]: every level must be an integer in "
     "1..4,096", ""),
    (["quality.prompts=100000000"], "quality.prompts=100000000: must be >= 1 and <= 100,000", ""),
    (["quality.chunks=100000000"], "quality.chunks=100000000: must be >= 1 and <= 10,000", ""),
    (["quality.top_k=100000"], "quality.top_k=100000: must be >= 1 and <= 1,000", ""),
    (["quality.depths=[512,100000000]"], "quality.depths=[512, 100000000]: allowed at most 64 depths of "
     "16..1,048,576 tokens", ""),
    (["backend.threads=100000"], "backend.threads=100000: must be >= 1 and <= 4,096", ""),
    (["backend.n_gpu_layers=100000000"], "backend.n_gpu_layers=100000000: must be >= -1 and <= 65,536", ""),
    (["model.n_layers=100000000"], "model.n_layers=100000000: must be >= 1 and <= 65,536", ""),
    ([*SEARCH, "scenario.search_resolution=0.000001"], "scenario.search_resolution=1e-06: fills "
     "scenario.concurrency=[1, 2] with 1,000,003 levels; allowed at most 4,096 per job", ""),
    # 3. the KV type per backend
    (["kv.per_backend.llamacpp=xyz"], "kv.per_backend.llamacpp='xyz': not a KV cache type backend=llamacpp accepts "
     "(the job: kv=fp16, backend=llamacpp); allowed values are f32, f16, bf16, q8_0", ""),
    (["kv.per_backend.llamacpp=q4_1"], "kv.per_backend.llamacpp='q4_1': a q4_1 KV cache, but the job (kv=fp16, "
     "backend=llamacpp) is labelled and reported as fp16; allowed for kv=fp16 on llamacpp: f16", ""),
    (["kv=q8_0", "kv.per_backend.llamacpp=f16"], "kv.per_backend.llamacpp='f16': a fp16 KV cache, but the job "
     "(kv=q8_0, backend=llamacpp) is labelled and reported as q8_0; allowed for kv=q8_0 on llamacpp: q8_0", ""),
    (["backend=vllm", "kv.per_backend.vllm=auto"], "kv.per_backend.vllm='auto': the model's own dtype, not a fixed "
     "one, but the job (kv=fp16, backend=vllm) is labelled and reported as fp16; allowed for kv=fp16 on vllm: "
     "float16", ""),
    (["backend=vllm", "kv.per_backend.vllm=q8_0"], "kv.per_backend.vllm='q8_0': not a KV cache type backend=vllm "
     "accepts (the job: kv=fp16, backend=vllm); allowed values are auto, float16, bfloat16, fp8", ""),
    (["kv=q8_0", "kv.per_backend.ollama=q4_0"], "kv.per_backend.ollama='q4_0': a q4_0 KV cache, but the job "
     "(kv=q8_0, backend=llamacpp) is labelled and reported as q8_0; allowed for kv=q8_0 on ollama: q8_0", ""),
    (["kv=fp8", "+kv.per_backend.llamacpp=q8_0"], "kv.per_backend.llamacpp='q8_0': a q8_0 KV cache, but the job "
     "(kv=fp8, backend=llamacpp) is labelled and reported as fp8; llamacpp has no fp8 KV cache", ""),
    (["+kv.per_backend.sglang=f16"], "kv.per_backend.sglang: no such backend; allowed keys are llamacpp, ollama, "
     "vllm", ""),
    (["kv.name=fp12"], "kv.name='fp12': not a KV cache dtype kvexp knows; allowed values are bf16, f32, fp16, fp8", ""),
    # 4. hosts, comma lists, settings nothing would read, levels given twice
    (["backend.host=not_a_host!!"], "backend.host='not_a_host!!': not an IP address or host name (e.g. 127.0.0.1, "
     "::1, localhost)", ""),
    (["backend.host='not_a_host!!'"], "backend.host='not_a_host!!': not an IP address or host name", ""),
    (["scenario.name=a)b"], "scenario.name=a)b: Hydra cannot parse this override (mismatched input ')'", "allowed:"),
    (["kv=fp16,q8_0"], "kv=fp16,q8_0: a comma list runs one job per value, a sweep: allowed with -m "
     "(python -m kvexp -m kv=fp16,q8_0 ...)", ""),
    (["scenario.time_scale=2"], "scenario.time_scale=2.0: only a trace replay (scenario.trace) is scaled in time; "
     "allowed: 1 without a trace", ""),
    (["scenario.max_concurrency=4"], "scenario.max_concurrency=4: caps open-loop levels (scenario.rates) only, and "
     "scenario.concurrency=[1, 2] is closed loop", "allowed: null"),
    (["scenario.search_resolution=2"], "scenario.search_resolution=2.0: only an SLO search (scenario.search) fills "
     "its grid; allowed: null without a search", ""),
    (["scenario.concurrency=[1,1]"], "scenario.concurrency=[1, 1]: level 1 is given twice", "allowed: distinct"),
    ([*RATES[:1], "scenario.rates=[2.5,1,2.5]"], "scenario.rates=[2.5, 1.0, 2.5]: level 2.5 is given twice", ""),
    (["scenario.search=rate", "scenario.slo_ttft_ms=100", RATES[0], "scenario.rates=[0.001,1]", "scenario.requests=100"],
     "scenario.rates=[0.001, 1.0]: level 0.001 sends its 100 requests (scenario.requests) over 27.8 hours",
     "within a day"),
    (["scenario.concurrency=[1,16]", "scenario.requests=8"], "scenario.concurrency=[1, 16]: level 16 never has that "
     "many requests in flight, as a level sends 8 (scenario.requests)", "allowed: levels up to scenario.requests"),
    (["scenario.search=concurrency", "scenario.slo_ttft_ms=100", "scenario.concurrency=[1,16]", "scenario.requests=8"],
     "scenario.concurrency=[1, 16]: level 16 never has that many", ""),
    (["scenario.concurrency=[1,2]", "scenario.repeats=600"], "scenario.repeats=600 x 2 levels: 1,200 level runs; "
     "allowed at most 1,024 per job", ""),
    (["kv=q4_0", "backend.flash_attn=off"], "kv=q4_0 (-ctv q4_0) with backend.flash_attn=off: llama-server refuses a "
     "quantised V cache without flash attention", "use backend.flash_attn=on or auto"),
    (["model.hf=/nonexistent/hf"], "model.hf: no job of this run serves it (backend=llamacpp serves model.gguf)", ""),
    # settings that nothing in the job would read
    (["scenario.arrival=poisson"], "scenario.arrival=poisson: only open-loop levels (scenario.rates) have arrivals", ""),
    (["scenario.conversation.think_time_s=2"], "scenario.conversation.think_time_s=2.0: the time between the turns",
     "allowed: 0 with one turn"),
    (["scenario.slo_percentile=p99"], "scenario.slo_percentile=p99: the percentile the latency objectives", ""),
    (["scenario.search_min_growth=0.2"], "scenario.search_min_growth=0.2: only an SLO search", ""),
    (["scenario.prefix_groups=4"], "scenario.prefix_groups=4: the number of shared prefixes", "without a prefix"),
    (["scenario.trace_block_tokens=16"], "scenario.trace_block_tokens=16: the tokens each hash id", "without a trace"),
    (["quality.depths=[64]"], "quality.depths=[64]: read only when the job measures quality, and this one does not",
     "allowed: quality.enabled=true (or scenario=quality)"),
    (["quality.prompts=2", "quality.seed=3"], "quality.prompts=2: read only when the job measures quality", ""),
    (["scenario=sharegpt", "scenario.conversation.turns=5"], "scenario.conversation.turns=5: a dataset entry's "
     "conversation replays its own user turns, and the longest in scenario.dataset=@sharegpt-tiny.jsonl has 3",
     "allowed: 1..3 with this dataset"),
    # flags kvexp sets, in the other spellings the servers read
    (["backend=vllm", "backend.extra_args=[--max_model_len,512]"], "backend.extra_args: --max_model_len is set by "
     "kvexp itself", "use backend.context"),
    (["backend=vllm", "backend.extra_args=[--max-model,512]"], "backend.extra_args: --max-model is set by kvexp itself",
     "use backend.context"),
    (["backend=vllm", "backend.extra_args=[--kv_cache_dtype,fp8]"], "backend.extra_args: --kv_cache_dtype is set", ""),
    (["backend.extra_args=[--no-slots]"], "backend.extra_args: --no-slots is set by kvexp itself", "slots"),
    (["backend.extra_args=[--log-disable]"], "backend.extra_args: --log-disable is set by kvexp itself", "log"),
    (["backend.extra_args=[-np8]"], "backend.extra_args: '-np8' is not a flag this llama-server reads; a flag and "
     "its value are two items: [-np,8]", ""),
    (["backend.extra_args=[--no-such-flag]"], "backend.extra_args: '--no-such-flag' is not a flag this llama-server "
     "reads", "--help` lists every one"),
    (["+backend.env.LLAMA_ARG_KV_UNIFIED=1"], "backend.env.LLAMA_ARG_KV_UNIFIED: llama.cpp reads every LLAMA_ARG_* "
     "variable as a command-line flag", "give the flag in backend.extra_args"),
    # 6. a label every reader would refuse
    (["label=" + "L" * 1001], "the job's label is 1,001 characters", "more than the 1,000 a name may have"),
    (["model.name=" + "m" * 1000], "the job's label is 1,020 characters", ""),
]


@pytest.mark.parametrize("overrides, starts, holds", REFUSED, ids=[" ".join(c[0]) for c in REFUSED])
def test_refused_in_one_line_before_anything_starts(tmp_path, capsys, overrides, starts, holds):
    assert kvexp_main(*overrides, f"hydra.run.dir={tmp_path}/run") == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"kvexp: {starts}"), err[0]
    assert holds in err[0]
    assert not (tmp_path / "run").exists() and not list(tmp_path.rglob("result.json"))


def test_a_flag_variable_in_kvexps_environment_is_refused(tmp_path, capsys, monkeypatch):
    """llama-server reads LLAMA_ARG_KV_UNIFIED from its environment, which kvexp passes on: the cache would
    change while kvexp planned and recorded the other one."""
    monkeypatch.setenv("LLAMA_ARG_KV_UNIFIED", "1")
    assert kvexp_main(f"hydra.run.dir={tmp_path}/run") == 1
    assert capsys.readouterr().err == ("kvexp: LLAMA_ARG_KV_UNIFIED=1 is set in kvexp's environment: llama.cpp reads "
                                       "every LLAMA_ARG_* variable as a command-line flag, which kvexp neither plans "
                                       "with nor records; unset it and give the flag in backend.extra_args\n")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides, starts", [
    (["scenario.stall_timeout_s=inf"], "scenario.stall_timeout_s=inf: must be > 0 and <= 86,400 s (a day)"),
    (["client.workers=100000000"], f"client.workers=100000000: allowed values are auto or 1..{CAP}"),
    (["kv.per_backend.llamacpp=q4_1"], "kv.per_backend.llamacpp='q4_1': a q4_1 KV cache, but the job (kv=fp16"),
    (["backend.host=not_a_host!!"], "backend.host='not_a_host!!': not an IP address or host name"),
    (["kv=fp16,q8_0"], "kv=fp16,q8_0: a comma list runs one job per value, a sweep: allowed with -m"),
    (["kv=fp16", "kv=q8_0"], "kv=fp16 and kv=q8_0: kv is given twice and only the last would count"),
    (["scenario.seed=1", "+scenario.seed=2"], "scenario.seed=1 and +scenario.seed=2: scenario.seed is given twice"),
    (["backend.extra_args=[--port,1]"], "backend.extra_args: --port is set by kvexp itself (its value is measured, "
     "recorded and hashed); use backend.host and backend.port"),
    (["backend=vllm", "backend.extra_args=['--kv-cache-dtype=fp8']"], "backend.extra_args: --kv-cache-dtype is set "
     "by kvexp itself"),
    (["label=a\x1b[2Jb"], "label=a\\x1b[2Jb: Hydra cannot parse this override"),
    (["label='a\nb'"], "the job's label 'a\\nb' holds '\\n' at position 1: it names files"),
    (["\x1b]0;owned\x07"], "\\x1b]0;owned\\x07: neither a command"),
], ids=["inf", "workers", "per_backend", "host", "comma-list", "repeated-group", "repeated-key", "managed-flag",
        "managed-flag-vllm", "escape", "newline",
        "stray-escape"])
def test_the_real_command_line_says_one_line_and_exits_1(tmp_path, overrides, starts):
    p = subprocess.run([sys.executable, "-m", "kvexp", *TINY, *overrides, f"hydra.run.dir={tmp_path}/run"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert p.returncode == 1, p.stderr[-2000:]
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvexp: {starts}"), p.stderr[-2000:]
    assert lines[0].isprintable(), lines[0]  # what was typed is quoted, never acted on by the terminal
    assert "Traceback" not in p.stderr and not list(tmp_path.rglob("result.json"))
    assert not (tmp_path / "run").exists() and not (tmp_path / "outputs").exists()


# ---------------------------------------------------------------- what stays allowed
@pytest.mark.parametrize("overrides", [
    ["scenario.stall_timeout_s=86400", "scenario.request_timeout_s=86400", "backend.ready_timeout_s=86400"],
    ["scenario.slo_ttft_ms=86400000", "scenario.slo_tpot_ms=0.5"],
    [f"client.workers={CAP}", "scenario.max_start_rate=100000", "model.params_b=7.6", "model.weights_gib=4.5"],
    [*SEARCH, "scenario.concurrency=[1,16]", "scenario.requests=16", "scenario.search_resolution=1"],
    [*RATES, "scenario.max_concurrency=4", "scenario.arrival=poisson"],
    ["scenario.slo_tpot_ms=50", "scenario.slo_percentile=p99"],
    ["scenario=multiturn", "scenario.conversation.think_time_s=2"],
    ["scenario=prefix", "scenario.prefix_groups=4"], ["scenario=trace", "scenario.trace_block_tokens=16"],
    ["scenario=trace", "scenario.time_scale=0.5"],
    ["quality.enabled=true", "quality.depths=[64]", "quality.prompts=2"], ["scenario=quality", "quality.chunks=2"],
    ["scenario=sharegpt", "scenario.conversation.turns=3"],
    ["kv=q4_0", "kv.per_backend.llamacpp=q4_0"],
    ["backend=vllm", "kv=fp8", "kv.per_backend.vllm=fp8_e5m2"],
    ["backend.host=::1"], ["backend.host=localhost"], ["client.workers=auto"], ["client.workers=1"],
])
def test_good_values_still_pass(overrides):
    for _, cfg in compose_all([*TINY, *overrides]):
        assert check(cfg, kv_choices()) is None


def test_every_shipped_option_passes_the_checks():
    kvs = kv_choices()
    for opt in _options("scenario"):
        assert check(compose([*TINY, f"scenario={opt}"]), kvs) is None, opt
    for opt in _options("kv"):
        for backend in kvs[opt].per_backend:
            extra = ["backend.endpoint=http://127.0.0.1:9", "model.ollama=tiny"] if backend == "ollama" else []
            assert check(compose([*TINY, f"backend={backend}", f"kv={opt}", *extra]), kvs) is None, (opt, backend)


def test_a_sweep_with_m_still_runs_each_value():
    jobs = compose_all([*TINY, "kv=fp16,q8_0"])
    assert [check(cfg, kv_choices(), multirun=True) for _, cfg in jobs] == [None, None]
    with pytest.raises(ConfigError, match=r"^kv=fp16,q8_0: a comma list"):
        check(jobs[0][1], kv_choices())


def test_every_adapter_has_its_kv_types_and_every_shipped_spelling_is_one():
    for name in REGISTRY:
        assert bounds.accepted_kv_types(name), name
    for opt, kv in kv_choices().items():
        for backend, spelling in kv.per_backend.items():
            assert spelling in bounds.accepted_kv_types(backend) and bounds.kv_dtype(spelling) == opt


def test_the_walk_finds_a_non_finite_float_anywhere():
    cfg = compose(TINY)
    cfg.scenario.prompt_dist.weights = [1.0, math.nan]
    with pytest.raises(ConfigError, match=r"^scenario\.prompt_dist\.weights=\[1\.0, nan\]: nan is not a finite"):
        bounds.check_finite(cfg)
    cfg = compose(TINY)
    cfg.gpu.memory_gib = -math.inf
    with pytest.raises(ConfigError, match=r"^gpu\.memory_gib=-inf: not a finite number"):
        bounds.check_finite(cfg)
    bounds.check_finite(compose(TINY))


def test_a_check_that_stumbles_over_inf_names_the_setting(monkeypatch):
    def overflow(cfg):
        int(cfg.scenario.search_min_growth)  # OverflowError: what a derived figure would raise

    monkeypatch.setattr(checks, "check_ranges", overflow)
    cfg = compose([*TINY, "scenario.search_min_growth=inf"])
    with pytest.raises(ConfigError, match=r"^scenario\.search_min_growth=inf: not a finite number"):
        checks.check_config(cfg, kv_choices())


def test_plan_refuses_a_number_that_is_not_finite(capsys):
    assert kvexp_main("plan", "model.params_b=inf") == 1
    assert capsys.readouterr().err == ("kvexp: model.params_b=inf: must be > 0 (or null: read from the model files) and "
                                       "<= 100,000 (100 trillion parameters)\n")  # the run's own check


def test_plan_refuses_a_key_given_twice(capsys):
    assert kvexp_main("plan", "kv=fp16", "kv=q8_0") == 1
    assert capsys.readouterr().err == ("kvexp: kv=fp16 and kv=q8_0: kv is given twice and only the last would "
                                       "count; give it once (one job per value is a sweep: -m kv=a,b)\n")


@pytest.mark.parametrize("key", ["backend.threads=1", "backend.extra_args=[--no-mmap]", "+backend.env.X=1",
                                 "backend.port=9000", "backend.kv_rotation=off", "backend.flash_attn=off"])
def test_a_launch_setting_for_an_attached_server_is_refused(tmp_path, capsys, key):
    """backend.endpoint attaches to a server already running: a launch setting beside it was ignored."""
    assert kvexp_main("backend.endpoint=http://127.0.0.1:9", key, f"hydra.run.dir={tmp_path}/run") == 1
    err = capsys.readouterr().err
    name = key.lstrip("+").split("=")[0]
    assert err == (f"kvexp: {name}: sets up a server kvexp launches, but backend.endpoint=http://127.0.0.1:9 "
                   "attaches to one already running, which kvexp does not restart or reconfigure; drop one of the "
                   "two\n"), err
    assert not (tmp_path / "run").exists()


def test_a_gpu_preset_for_a_server_on_the_cpu_is_refused(tmp_path, capsys):
    """gpu=h100 on a machine without a GPU: the server runs on the CPU and every result would have been
    labelled H100."""
    from kvexp.measure.gpu import gpu_info

    if gpu_info(quiet=True).name is not None:
        hardware_skip("NVML sees a GPU here; the refusal is for a machine without one")
    assert kvexp_main("gpu=h100", f"hydra.run.dir={tmp_path}/run") == 1
    err = capsys.readouterr().err
    assert err.startswith("kvexp: gpu.name=NVIDIA H100") and "kvexp sees no GPU here" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()
