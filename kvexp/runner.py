"""One job: a server with one KV configuration, driven through one scenario's levels.

The runner owns the order of things (launch or attach, check the KV cache the server reports, warm
up, measure each level while sampling memory and the server's telemetry, write results after every
level) and nothing else: timing is the load generator's, maths is stats.py's, formats are results.py's."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import aiohttp

from kvexp import prompts, stats
from kvexp.backends.base import Backend, BackendError, KVCacheInfo
from kvexp.backends.process import ServerProcess, free_port, tail
from kvexp.config import ConfigError, ExperimentConfig, job_label, to_plain
from kvexp.gpu import GIB, MemorySampler, gpu_info
from kvexp.loadgen import LoadGenerator, LoopLagMonitor, Observer, RequestRecord, arrival_offsets, make_session
from kvexp.results import (REQUESTS_FILE, RESULT_FILE, config_hash, environment, utc_now, write_json,
                           write_jsonl)

log = logging.getLogger("kvexp")
POLL_INTERVAL_S = 0.2
CLIENT_LAG_LIMIT_MS = 20.0  # event-loop lag (p99) above this: the client may have limited the level


def server_program(cfg: ExperimentConfig) -> Optional[str]:
    """The program that launches cfg's server (None when attaching to an endpoint or for Ollama's
    default on PATH); raises ConfigError saying how to get it when it is missing."""
    if cfg.backend.endpoint:
        return None
    name = cfg.backend.name
    if name == "llamacpp":
        from kvexp.install import find_llama_server

        found = find_llama_server(cfg.backend.binary)
        if found is None:
            where = f"backend.binary={cfg.backend.binary}" if cfg.backend.binary else "PATH or kvexp's cache"
            raise ConfigError(f"llama-server not found in {where}: run `python -m kvexp install llamacpp` "
                              "(builds it once, ~5 min) or set backend.binary=/path/to/llama-server")
        return str(found)
    if name == "vllm":
        from kvexp.install import vllm_python

        python = cfg.backend.python or (str(p) if (p := vllm_python()) else None)
        if python is None:
            raise ConfigError("vLLM not found: run `python -m kvexp install vllm` or set "
                              "backend.python=/path/to/python-with-vllm")
        return python
    return cfg.backend.binary


def make_backend(cfg: ExperimentConfig) -> Backend:
    """The adapter for cfg.backend.name, with its model and program resolved."""
    name = cfg.backend.name
    program = server_program(cfg)
    if name == "llamacpp":
        from kvexp.backends.llamacpp import LlamaCpp
        from kvexp.tinymodels import ensure_tiny_gguf

        gguf = cfg.model.gguf
        if gguf == "@tiny":
            gguf = str(ensure_tiny_gguf())
        elif not cfg.backend.endpoint and (not gguf or not Path(gguf).expanduser().is_file()):
            raise ConfigError(f"model.gguf={gguf!r}: no such GGUF file for model={cfg.model.name}")
        return LlamaCpp(cfg, gguf, program)
    if name == "vllm":
        from kvexp.backends.vllm import VLLM
        from kvexp.tinymodels import ensure_tiny_hf

        hf = cfg.model.hf
        if hf == "@tiny" and program:
            hf = str(ensure_tiny_hf(Path(program)))
        if not hf and not cfg.backend.endpoint:
            raise ConfigError(f"model.hf is not set for model={cfg.model.name}: give a local folder or a model id")
        return VLLM(cfg, hf, program)
    if name == "ollama":
        from kvexp.backends.ollama import Ollama

        if not cfg.model.ollama:
            raise ConfigError(f"model.ollama is not set for model={cfg.model.name}: give an Ollama model tag")
        return Ollama(cfg, cfg.model.ollama, program)
    raise ConfigError(f"backend.name={name!r}: allowed values are llamacpp, vllm, ollama")


@dataclass
class _Server:
    """A launched server and what it was launched with (to reuse it for an identical next job)."""

    key: tuple
    process: ServerProcess
    base_url: str
    launch_command: list[str]
    ready_s: float


class ServerPool:
    """Keeps the last launched server so that a consecutive job with an identical launch reuses it."""

    def __init__(self) -> None:
        self.current: Optional[_Server] = None

    def release(self) -> None:
        if self.current is not None:
            self.current.process.stop()
            self.current = None

    def acquire(self, backend: Backend, cfg: ExperimentConfig, log_path: Path) -> tuple[_Server, bool]:
        argv0 = backend.launch_argv(0)
        key = (tuple(argv0), tuple(sorted(backend.launch_env().items())))
        cur = self.current
        if cur is not None and cur.key == key and cur.process.exited() is None:
            return cur, True
        self.release()
        port = cfg.backend.port or free_port(cfg.backend.host)
        argv = backend.launch_argv(port)
        proc = ServerProcess(argv, backend.launch_env(), log_path, f"{cfg.backend.name} server")
        proc.start()
        base = f"http://{_url_host(cfg.backend.host)}:{port}"
        try:
            ready = proc.wait_ready(base + backend.health_path, cfg.backend.ready_timeout_s)
        except BaseException:
            proc.stop()
            raise
        self.current = _Server(key, proc, base, argv, ready)
        return self.current, False


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


POOL = ServerPool()


@dataclass
class Job:
    cfg: ExperimentConfig
    out_dir: Path
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def result_path(self) -> Path:
        return self.out_dir / RESULT_FILE

    def save(self) -> None:
        write_json(self.result_path, self.result, "result")


def new_result(cfg: ExperimentConfig, backend_name: str, variable_length: bool) -> dict[str, Any]:
    plain = to_plain(cfg)
    plain.pop("output_dir", None)
    plain["backend"].pop("api_key_env", None)
    gi = gpu_info(cfg.gpu.index)
    s = cfg.scenario
    return {
        "schema_version": 1,
        "kind": "kvexp.job",
        "kvexp_version": environment()["kvexp_version"],
        "label": job_label(cfg),
        "status": "partial",
        "status_reason": None,
        "started_at": utc_now(),
        "finished_at": None,
        "backend": {"name": backend_name, "version": None, "launch_command": None, "endpoint": None,
                    "reused_server": False, "ready_s": None, "server_log": None},
        "model": {"name": cfg.model.name, "path": None},
        "kv": {"requested": cfg.kv.name, "backend_dtype": cfg.kv.per_backend.get(backend_name, "?"),
               "bytes_per_element": cfg.kv.bytes_per_element},
        "kv_cache": {"dtype": None, "blocks": None, "block_size": None, "gpu_memory_utilization": None},
        "scenario": {"name": s.name, "prompt_tokens": s.prompt_tokens, "max_tokens": s.max_tokens,
                     "mode": "open" if s.rates else "closed", "variable_length": variable_length,
                     "api": s.api},
        "gpu": {"name": cfg.gpu.name or gi.name, "memory_gib": cfg.gpu.memory_gib or gi.memory_gib,
                "driver": gi.driver},
        "environment": environment({"event_loop": type(asyncio.get_event_loop_policy()).__name__}),
        "config": plain,
        "config_hash": config_hash(plain),
        "planner": None,
        "timing": {},
        "requests_file": REQUESTS_FILE,
        "levels": [],
    }


def run_job(cfg: ExperimentConfig, out_dir: Path, observer: Optional[Observer] = None,
            pool: ServerPool = POOL) -> dict[str, Any]:
    """Run one job and return its result (also written to out_dir/result.json after every level)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    backend = make_backend(cfg)
    job = Job(cfg, out_dir, new_result(cfg, backend.name, not backend.forces_output_length))
    res = job.result
    res["model"]["path"] = getattr(backend, "model_path", None)
    (out_dir / REQUESTS_FILE).unlink(missing_ok=True)
    log_path = out_dir / "server.log"
    server: Optional[_Server] = None
    t0 = time.monotonic()
    try:
        if cfg.backend.endpoint:
            backend.base_url = cfg.backend.endpoint.rstrip("/")
            res["backend"]["endpoint"] = backend.base_url
        else:
            server, reused = pool.acquire(backend, cfg, log_path)
            backend.base_url = server.base_url
            res["backend"].update(endpoint=server.base_url, launch_command=server.launch_command,
                                  env=backend.launch_env() or None, reused_server=reused,
                                  ready_s=round(server.ready_s, 3),
                                  server_log=str(server.process.log_path))
            res["timing"]["server_start_s"] = 0.0 if reused else round(server.ready_s, 3)
        job.save()
        asyncio.run(_measure(job, backend, server, observer))
        failed = [lv for lv in res["levels"] if lv["status"] == "failed"]
        res["status"] = "complete" if not failed else "partial"
        _learn(res)
        if failed:
            res["status_reason"] = f"{len(failed)} level(s) failed: " + "; ".join(
                lv.get("status_reason") or "" for lv in failed)
    except (BackendError, ConfigError, OSError, aiohttp.ClientError, RuntimeError) as e:
        res["status"] = "failed"
        res["status_reason"] = str(e).splitlines()[0]
        if log_path.exists():
            res["backend"]["log_tail"] = tail(log_path, 20)
        if server is not None:
            pool.release()
        raise
    finally:
        res["finished_at"] = utc_now()
        res["timing"]["total_s"] = round(time.monotonic() - t0, 3)
        job.save()
    return res


async def _measure(job: Job, backend: Backend, server: Optional[_Server], observer: Optional[Observer]) -> None:
    cfg, res = job.cfg, job.result
    s = cfg.scenario
    max_conn = max([*s.concurrency, s.max_concurrency or 0, 1]) + 4
    headers = None
    if cfg.backend.api_key_env:
        key = os.environ.get(cfg.backend.api_key_env)
        if not key:
            raise ConfigError(f"backend.api_key_env={cfg.backend.api_key_env}: that environment variable is not set")
        headers = {"Authorization": f"Bearer {key}"}
    async with make_session(backend.base_url, max_conn, s.request_timeout_s, s.stall_timeout_s, headers) as session:
        res["backend"]["version"] = await backend.version(session)
        log_text = server.process.log_path.read_text(errors="replace") if server else ""
        kv = await backend.kv_cache(session, log_text)
        _record_kv(res, kv, backend)
        job.save()
        _check_kv(cfg, kv, backend)
        res["planner"] = _planner_block(cfg, res, getattr(backend, "model_path", None))
        lg = LoadGenerator(session, backend, observer)
        maker = await PromptMaker.create(backend, session, s.prompt_tokens, s.api, s.seed)
        sampler = MemorySampler(server.process.pid if server else None, cfg.gpu.index, cfg.gpu.sample_interval_s)
        sampler.start()
        try:
            tw = time.monotonic()
            if s.warmup_requests:
                warm = await maker.requests(s.warmup_requests, s.max_tokens, level=0, repeat=0, warmup=True)
                await lg.closed_loop(warm, min(s.warmup_requests, max(s.concurrency or [1])))
                write_jsonl(job.out_dir / REQUESTS_FILE, (r.to_json() for _, r in warm))
            res["timing"]["warmup_s"] = round(time.monotonic() - tw, 3)
            tm = time.monotonic()
            levels = [("concurrency", c) for c in s.concurrency] if not s.rates else [("rate", r) for r in s.rates]
            for kind, value in levels:
                for repeat in range(s.repeats):
                    summary = await _run_level(job, backend, session, lg, maker, sampler, kind, value, repeat, observer)
                    res["levels"].append(summary)
                    job.save()
            res["timing"]["measure_s"] = round(time.monotonic() - tm, 3)
        finally:
            sampler.stop()


class PromptMaker:
    """Unique prompts of the exact target length, as the server's tokenizer counts them."""

    def __init__(self, backend: Backend, session: aiohttp.ClientSession, pool: Optional[list[int]],
                 target: int, api: str, seed: int):
        self.backend, self.session = backend, session
        self.pool, self.target, self.api, self.seed = pool, target, api, seed
        self.counter = 0

    @classmethod
    async def create(cls, backend: Backend, session: aiohttp.ClientSession, target: int, api: str,
                     seed: int) -> "PromptMaker":
        pool = None
        if api == "completions" and getattr(backend, "exact_prompts", True):
            pool = await prompts.token_pool(backend, session, seed)
        return cls(backend, session, pool, target, api, seed)

    async def one(self) -> str | list[int]:
        self.counter += 1
        seed = self.seed * 1_000_003 + self.counter
        if self.pool is not None:
            return prompts.token_prompts(self.pool, 1, self.target, seed)[0]
        if getattr(self.backend, "exact_prompts", True):
            count = self.backend.chat_prompt_tokens
            text = await prompts.exact_text(count, self.target, random.Random(seed), self.session)
            if text is None:
                raise RuntimeError(f"could not build a chat prompt of exactly {self.target} tokens")
            return text
        return prompts.estimated_text(1, self.target, seed)[0]

    async def requests(self, n: int, max_tokens: int, level: float, repeat: int,
                       warmup: bool = False) -> list[tuple[Any, RequestRecord]]:
        out = []
        for i in range(n):
            rec = RequestRecord(index=i, level=level, repeat=repeat, warmup=warmup,
                                target_prompt_tokens=self.target, max_tokens=max_tokens)
            out.append((self.backend.request(await self.one(), max_tokens, self.api), rec))
        return out


class TelemetryPoller:
    """Polls the server's own metrics during a level: peak KV usage, peak running/waiting."""

    def __init__(self, backend: Backend, session: aiohttp.ClientSession):
        self.backend, self.session = backend, session
        self.kv_usage: list[float] = []
        self.running: list[int] = []
        self.waiting: list[int] = []
        self.failures = 0
        self._task: Optional[asyncio.Task] = None

    async def sample(self):
        try:
            return await self.backend.poll(self.session)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError):
            self.failures += 1
            return None

    async def _run(self) -> None:
        while True:
            t = await self.sample()
            if t is not None:
                if t.kv_usage is not None:
                    self.kv_usage.append(t.kv_usage)
                if t.running is not None:
                    self.running.append(t.running)
                if t.waiting is not None:
                    self.waiting.append(t.waiting)
            await asyncio.sleep(POLL_INTERVAL_S)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass


async def _run_level(job: Job, backend: Backend, session: aiohttp.ClientSession, lg: LoadGenerator,
                     maker: PromptMaker, sampler: MemorySampler, kind: str, value: float, repeat: int,
                     observer: Optional[Observer]) -> dict[str, Any]:
    s = job.cfg.scenario
    reqs = await maker.requests(s.requests, s.max_tokens, value, repeat)
    before = await TelemetryPoller(backend, session).sample()
    poller = TelemetryPoller(backend, session)
    sampler.window()
    if observer:
        observer.level_started(value, s.requests, repeat)
    poller.start()
    with LoopLagMonitor() as lag:
        if kind == "concurrency":
            records = await lg.closed_loop(reqs, int(value))
        else:
            offsets = arrival_offsets(len(reqs), value, s.arrival, s.seed + repeat)
            records = await lg.open_loop(reqs, offsets, s.max_concurrency)
    await poller.stop()
    after = await TelemetryPoller(backend, session).sample()
    mem = sampler.window()
    write_jsonl(job.out_dir / REQUESTS_FILE, (r.to_json() for r in records))

    summary = stats.summarize_level(records)
    lag_p99 = stats.percentile(lag.lags_s, 99)
    level: dict[str, Any] = {
        "concurrency": int(value) if kind == "concurrency" else None,
        "rate": value if kind == "rate" else None,
        "repeat": repeat,
        "status": "ok",
        **summary,
        "peak_vram_gib": _gib(mem.device_used_bytes),
        "peak_server_gpu_gib": _gib(mem.server_gpu_bytes),
        "peak_rss_gib": _gib(mem.server_rss_bytes),
        "peak_kv_cache_usage": round(max(poller.kv_usage), 4) if poller.kv_usage else None,
        "kv_usage_samples": len(poller.kv_usage),
        "preemptions": _delta(before, after),
        "max_running": max(poller.running) if poller.running else None,
        "max_waiting": max(poller.waiting) if poller.waiting else None,
        "loop_lag_p99_ms": None if lag_p99 is None else round(lag_p99 * 1000, 3),
        "goodput_req_s": stats.goodput(records, s.slo_ttft_ms, s.slo_tpot_ms, summary["wall_s"]),
    }
    if kind == "rate":
        level["achieved_rate"] = summary["request_rate"]
    level["client_limited"] = bool(lag_p99 is not None and lag_p99 * 1000 > CLIENT_LAG_LIMIT_MS)
    level["warnings"] = _warnings(level, records, s, backend.forces_output_length)
    if level["requests"] and level["errors"] / level["requests"] > s.max_error_rate:
        level["status"] = "failed"
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(summary["errors_by_kind"].items()))
        first = next((r.error for r in records if r.error), "")
        level["status_reason"] = (f"{level['errors']}/{level['requests']} requests failed ({kinds}); "
                                  f"first: {first}")[:500]
    if observer:
        observer.level_done(value, level)
    return level


def _warnings(level: dict[str, Any], records: list[RequestRecord], s: Any, forced: bool) -> list[str]:
    w = []
    ok = [r for r in records if r.ok]
    if level["errors"]:
        w.append(f"{level['errors']} of {level['requests']} requests failed")
    if level["requests"] < 20:
        w.append(f"only {level['requests']} requests: percentiles are rough")
    bad_prompt = [r for r in ok if r.prompt_tokens is not None and r.prompt_tokens != r.target_prompt_tokens]
    if bad_prompt and forced:
        w.append(f"{len(bad_prompt)} requests had a prompt length other than {s.prompt_tokens} tokens")
    bad_out = [r for r in ok if r.output_tokens != s.max_tokens]
    if bad_out and forced:
        w.append(f"{len(bad_out)} requests produced other than {s.max_tokens} output tokens")
    p50, p95 = level.get("ttft_p50_ms"), level.get("ttft_p95_ms")
    if p50 and p95 and p95 > 3 * p50:
        w.append(f"wide TTFT spread: p95 {p95:.1f} ms is over 3x p50 {p50:.1f} ms")
    if level["peak_kv_cache_usage"] is not None and level["kv_usage_samples"] < 5:
        w.append(f"KV usage was sampled only {level['kv_usage_samples']} times in this level: its peak is a lower bound")
    if level["client_limited"]:
        w.append(f"client event loop lagged {level['loop_lag_p99_ms']} ms (p99): the client may have limited this level")
    return w


def _delta(before: Any, after: Any) -> Optional[float]:
    if before is None or after is None or before.preemptions_total is None or after.preemptions_total is None:
        return None
    return after.preemptions_total - before.preemptions_total


def _gib(b: Optional[int]) -> Optional[float]:
    return None if b is None else round(b / GIB, 3)


def _record_kv(res: dict[str, Any], kv: KVCacheInfo, backend: Backend) -> None:
    res["kv_cache"] = {
        "dtype": kv.dtype, "blocks": kv.blocks, "block_size": kv.block_size,
        "gpu_memory_utilization": kv.gpu_memory_utilization, "dtype_k": kv.dtype_k, "dtype_v": kv.dtype_v,
        "capacity_tokens": kv.capacity_tokens, "bytes": kv.bytes, "max_concurrency": kv.max_concurrency,
        "seqs": kv.seqs, "source": kv.source,
    }


def _check_kv(cfg: ExperimentConfig, kv: KVCacheInfo, backend: Backend) -> None:
    """A server that reports a different KV type than the one asked for fails the job loudly."""
    asked = cfg.kv.per_backend.get(backend.name)
    if kv.dtype is None:
        log.warning("%s did not report its KV cache type; kv=%s (%s) is what was asked, not confirmed",
                    backend.name, cfg.kv.name, asked)
        return
    if kv.dtype != asked:
        raise BackendError(f"the server reports KV cache type {kv.dtype!r} but kv={cfg.kv.name} asked for "
                           f"{asked!r} on {backend.name}")


def _planner_block(cfg: ExperimentConfig, res: dict[str, Any], model_path: Optional[str]) -> Optional[dict[str, Any]]:
    """The planner's prediction for this job, beside what will be measured (None if it cannot plan)."""
    from kvexp import calibration, planner

    try:
        return planner.plan_for_job(cfg, model_path=model_path, gpu_name=res["gpu"]["name"],
                                    gpu_gib=res["gpu"]["memory_gib"], calibration=calibration.load())
    except (ValueError, OSError, KeyError, calibration.CalibrationError) as e:
        log.warning("planner: no prediction for %s: %s", res["label"], e)
        return None


def _learn(res: dict[str, Any]) -> None:
    """Feed a finished job's engine-reported capacity into the calibration file."""
    from kvexp import calibration

    try:
        calibration.update([res])
    except (ValueError, OSError, KeyError, calibration.CalibrationError) as e:
        log.warning("calibration: not updated from %s: %s", res["label"], e)


def skipped_result(cfg: ExperimentConfig, out_dir: Path, reason: str) -> dict[str, Any]:
    """A job that was not run (an unsupported backend/KV pair with unsupported=skip), recorded as such."""
    out_dir.mkdir(parents=True, exist_ok=True)
    job = Job(cfg, out_dir, new_result(cfg, cfg.backend.name, False))
    job.result.update(status="skipped", status_reason=reason, finished_at=utc_now())
    job.save()
    return job.result
