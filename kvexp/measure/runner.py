"""One job: a server with one KV configuration, driven through one scenario's levels.

The runner owns the order of things (launch or attach, check the KV cache the server reports, warm
up, measure each level while sampling memory and the server's telemetry, write results after every
level) and nothing else: timing is the load generator's, maths is stats.py's, formats are results.py's."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import aiohttp

from kvexp import backends
from kvexp.assets import embedded
from kvexp.backends.base import Adapter, BackendError, KVCacheInfo, auth_headers
from kvexp.backends.pool import Server, ServerPool
from kvexp.backends.process import continued, raise_if_interrupted, tail
from kvexp.capacity import modelinfo
from kvexp.capacity.planner import ModelArch
from kvexp.core import machine, placement
from kvexp.core.config import ConfigError, ExperimentConfig, client_connections, job_label, skips_unsupported
from kvexp.core.paths import SpaceReserve
from kvexp.measure.client import ClientOptions, Observer, client_environment, connection_error, make_session
from kvexp.measure.gpu import GIB, MemorySampler, gpu_info
from kvexp.measure.loadgen import LoadGenerator, arrival_offsets
from kvexp.measure.telemetry import TelemetrySampler
from kvexp.measure.traffic import Traffic
from kvexp.measure.watch import ServerHung, ServerWatch, hung_level_run, process_tree_writes, raise_if_hung
from kvexp.metrics import search, stats
from kvexp.metrics.levels import Level, kv_peak, level_warnings, workload_warnings
from kvexp.planning import calibration, prediction
from kvexp.quality import measure as quality
from kvexp.quality.inputs import check_inputs
from kvexp.results.blocks import Plan, Search, Workload
from kvexp.results.documents import (BackendInfo, GPUInfo, JobResult, KVAsked, KVCache, ModelInfo, ScenarioInfo,
                                    Timing)
from kvexp.results.store import (REQUESTS_FILE, RESULT_FILE, config_hash, environment, finished_levels, keep_requests,
                                 previous_result, spec_of, utc_now, write_json, write_jsonl)
from kvexp.results.validate import SCHEMA_VERSION
from kvexp.workload import scenario
from kvexp.workload.trace import trace_rate

log = logging.getLogger("kvexp")
POLL_INTERVAL_S = 0.2



@dataclass
class Job:
    cfg: ExperimentConfig
    out_dir: Path
    result: JobResult = field(default_factory=JobResult)
    kept: dict[float, list[Level]] = field(default_factory=dict)  # level value -> its repeats kept (resume)
    client: Optional[dict[str, Any]] = None  # the client as the environment records it, over the levels so far

    @property
    def result_path(self) -> Path:
        return self.out_dir / RESULT_FILE

    @property
    def plan(self) -> list[tuple[str, float]]:
        """The scenario's levels in order: (kind, value), kind concurrency or rate."""
        s = self.cfg.scenario
        if s.trace:  # one level: the trace at its own pace (x time_scale)
            return [("rate", trace_rate(s))]
        if s.search:  # the grid an SLO search moves on (kvexp/metrics/search.py)
            return [(s.search, int(x) if s.search == "concurrency" else x) for x in search.scenario_grid(s)]
        return [("rate", r) for r in s.rates] if s.rates else [("concurrency", c) for c in s.concurrency]

    def save(self) -> None:
        write_json(self.result_path, self.result.to_json(), "result")

    def add_level(self, level: Level) -> None:
        """Record a measured level in the plan's order (a resumed job mixes kept and new ones) and save."""
        repeats = range(self.cfg.scenario.repeats)
        order = {key: i for i, key in enumerate((v, r) for _, v in self.plan for r in repeats)}
        levels = self.result.levels
        levels.append(level)
        levels.sort(key=lambda lv: order.get((lv.x[1] if lv.x else None, lv.repeat), len(order)))
        self.save()


def new_result(cfg: ExperimentConfig, backend: Optional[Adapter]) -> JobResult:
    """A job's result before anything is measured (backend None: a job that was not run)."""
    plain = spec_of(cfg)
    gi = gpu_info(cfg.gpu.index)
    s = cfg.scenario
    return JobResult(
        schema_version=SCHEMA_VERSION, kind="kvexp.job", kvexp_version=environment()["kvexp_version"],
        label=job_label(cfg), status="partial", status_reason="unfinished: the job was running when this was written",
        started_at=utc_now(),
        backend=BackendInfo(name=cfg.backend.name, reused_server=False),
        model=ModelInfo(name=cfg.model.name, path=backend.model_path if backend else None),
        kv=KVAsked(requested=cfg.kv.name, backend_dtype=cfg.kv.per_backend.get(cfg.backend.name, "?"),
                   bytes_per_element=backend.spec.kv_bytes_per_element if backend else None),
        server=backend.spec.to_json() if backend else None,
        scenario=ScenarioInfo(name=s.name, prompt_tokens=s.prompt_tokens, max_tokens=s.max_tokens,
                              mode="open" if s.rates or s.trace else "closed",
                              variable_length=bool(backend) and not backend.capabilities.forces_output_length,
                              api=s.api),
        gpu=GPUInfo(name=cfg.gpu.name or gi.name, memory_gib=cfg.gpu.memory_gib or gi.memory_gib, driver=gi.driver),
        environment=environment({"event_loop": type(asyncio.get_event_loop_policy()).__name__}),
        config=plain, config_hash=config_hash(plain), timing=Timing(), requests_file=REQUESTS_FILE)


def run_job(cfg: ExperimentConfig, out_dir: Path, observer: Optional[Observer] = None,
            pool: Optional[ServerPool] = None, in_sweep: bool = False) -> JobResult:
    """Run one job and return its result (also written to out_dir/result.json after every level).

    With cfg.resume, a result already in out_dir from the same spec keeps its finished levels and only
    the missing ones are measured; one from another spec is refused (ResultError, nothing written).
    Whatever ends the job (a dead server, an error, an interrupt), the result says why, with the server
    log's tail, and a server is kept in `pool` for the next job only after a complete one (no pool:
    the job's server is stopped when it ends). A KV dtype the server cannot run here is recorded as
    skipped where cfg.unsupported says so for a job of a sweep (in_sweep) or a single run."""
    own_pool = pool is None
    pool = pool or ServerPool()
    out_dir.mkdir(parents=True, exist_ok=True)
    backend = backends.create(cfg)
    unsupported = backend.unsupported_reason()  # e.g. fp8 KV on this CPU
    if unsupported and skips_unsupported(cfg.unsupported, in_sweep):
        return unrun_result(cfg, out_dir, unsupported)
    if unsupported:
        raise ConfigError(unsupported)
    job = Job(cfg, out_dir, new_result(cfg, backend))
    if cfg.resume and _resume(job) and not quality.missing(cfg, job.result.quality):
        return job.result
    if not cfg.resume:
        (out_dir / REQUESTS_FILE).unlink(missing_ok=True)
    res = job.result
    if res.timing is None:  # a resumed result that recorded none
        res.timing = Timing()
    timing, env = res.timing, res.environment  # (the environment: its keys are this module's)
    log_path = out_dir / "server.log"
    server: Optional[Server] = None
    # the model's files are read here, once, before any server runs: nothing slow on the event loop
    # between a server's start and its last level (a pooled connection would go stale meanwhile)
    arch = _model_arch(backend)
    if arch is not None:
        res.model = replace(res.model, **modelinfo.weights_of(arch), architecture=modelinfo.architecture_of(arch))
    served = backend.served_field(cfg.model)
    res.model.origin = embedded.origin(getattr(cfg.model, served, None), served == "gguf")
    reserve = SpaceReserve(out_dir)  # a full disk mid-job still leaves room to record why it failed
    t0 = time.monotonic()
    try:
        if quality.wanted(cfg):  # its inputs, before any server starts
            check_inputs(cfg, arch)
        if cfg.backend.endpoint:
            backend.base_url = cfg.backend.endpoint.rstrip("/")
            res.backend.endpoint = backend.base_url
        else:
            server, reused = pool.acquire(backend, cfg, log_path)
            backend.base_url = server.base_url
            b = res.backend
            b.endpoint, b.launch_command, b.env, b.reused_server = (
                server.base_url, server.launch_command, server.process.env or None, reused)
            b.ready_s, b.server_log = round(server.ready_s, 3), str(server.process.log_path)
            timing.server_start_s = 0.0 if reused else round(server.ready_s, 3)
        server_pid = server.process.pid if server else None
        env["placement"] = backend.placement.to_json(placement.tree_cpus(server_pid))
        job.save()
        with placement.client_side(backend.placement):  # the server on its CPUs, the client on the others
            asyncio.run(_measure(job, backend, server, observer, arch))
        seen = placement.tree_cpus(server_pid)  # after the levels: every process and thread the server started
        if seen is not None:
            env["placement"] = backend.placement.to_json(seen)
        raise_if_interrupted()
        if quality.wanted(cfg):  # what the KV dtype costs in quality
            res.quality = quality.measure(cfg, res, backend, out_dir)
        failed = [lv for lv in res.levels if lv.failed]
        res.status = "complete" if not failed else "partial"
        res.status_reason = None
        _learn(res)
        if failed:
            res.status_reason = f"{len(failed)} level(s) failed: " + "; ".join(lv.status_reason or "" for lv in failed)
    except BaseException as e:
        res.status = "partial" if isinstance(e, KeyboardInterrupt) else "failed"
        res.status_reason = _reason(e, server, len(res.levels))
        raise
    finally:
        if server is not None:  # the server's log (kept under log.max_mb), and what it dropped
            for key, value in server.process.log_figures().items():  # (BackendInfo's server_log* fields)
                setattr(res.backend, key, value)
        said = server.process.log_path if server is not None else log_path  # a reused server's is an earlier job's
        if said.exists() and (res.status != "complete" or any(lv.errors for lv in res.levels)):
            res.backend.log_tail = tail(said, 20)
        res.finished_at = utc_now()
        timing.total_s = round(time.monotonic() - t0, 3)
        reserve.release()
        job.save()
        if server is not None and (own_pool or res.status != "complete"):
            pool.release()
    return res


def _resume(job: Job) -> bool:
    """Take up the result a previous run of this job left: keep its finished levels (and their lines
    of requests.jsonl). True when nothing is left to measure (job.result is then that result)."""
    res = job.result
    prev = previous_result(job.result_path, res.config_hash or "")
    job.kept = finished_levels(prev.levels, job.cfg.scenario.repeats) if prev else {}
    if prev and all(len(job.kept.get(v, [])) == job.cfg.scenario.repeats for _, v in job.plan):
        job.result = prev.own()  # (its quality may still be measured into it)
        if prev.status != "complete" and not quality.missing(job.cfg, prev.quality):  # after its last level
            prev.update(status="complete", status_reason=None)
            job.save()
        return True
    res.levels = [lv for _, v in job.plan for lv in job.kept.get(v, [])]
    if prev:
        res.started_at = prev.started_at
        res.resumed_at = [*(prev.resumed_at or []), utc_now()]
        log.info("%s: resuming: %d level(s) kept, the others are measured again", res.label, len(res.levels))
    keep_requests(job.out_dir / REQUESTS_FILE, {(lv.x[1], lv.repeat) for lv in res.levels if lv.x})
    return False


def _reason(e: BaseException, server: Optional[Server], measured: int) -> str:
    """Why a job ended early, in one line."""
    if isinstance(e, KeyboardInterrupt):
        return f"interrupted by {e or 'SIGINT'} after {measured} level(s)"
    gone = server.process.exit_reason() if server else None
    if gone:
        return f"{gone} after {measured} level(s); its last lines are in backend.log_tail"
    text = str(e).splitlines()[0] if str(e) else ""
    if isinstance(e, OSError) and e.strerror:  # e.g. a full disk while writing a result
        return f"cannot write {e.filename}: {e.strerror}" if e.filename else f"OS error: {e.strerror}"
    return text if isinstance(e, (BackendError, ConfigError)) else f"{type(e).__name__}: {text}".rstrip(": ")


def _check_alive(server: Optional[Server]) -> None:
    """Stop measuring as soon as the server process has died (no requests to a dead port)."""
    gone = server.process.exit_reason() if server else None
    if gone:
        raise BackendError(gone)


ATTACHED_PROBE_S = 5.0  # how long an attached server's health endpoint may take to answer


async def _check_attached(backend: Adapter, session: aiohttp.ClientSession) -> None:
    """An attached server (backend.endpoint) has no process to watch: before each level its health
    endpoint must answer, else the job ends as it would for a launched server that died."""
    url = backend.base_url + backend.health_path
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=ATTACHED_PROBE_S)) as r:
            await r.read()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        raise BackendError(f"the attached server at {backend.base_url} does not answer {url} "
                           f"({connection_error(e)})") from None


async def _measure(job: Job, backend: Adapter, server: Optional[Server], observer: Optional[Observer],
                   arch: Optional[ModelArch]) -> None:
    cfg, res = job.cfg, job.result
    timing = res.timing
    assert timing is not None  # (run_job's)
    s = cfg.scenario
    max_conn = client_connections(s)
    headers = auth_headers(cfg)
    async with make_session(backend.base_url, max_conn, s.request_timeout_s, s.stall_timeout_s, headers) as session:
        if server is None:  # an attached server that does not answer ends the job before anything is read from it
            await _check_attached(backend, session)
        res.backend.version = await backend.version(session)
        t = time.monotonic()
        if await backend.preload(session):  # a lazily loading server (Ollama) prints its KV lines after a load
            timing.model_load_s = round(time.monotonic() - t, 3)
        # the server's own VRAM accounting (Ollama's /api/ps)
        res.backend.loaded_models = await backend.loaded_models(session)
        log_text = await _server_log(backend, server)
        kv = await backend.kv_cache(session, log_text)
        res.kv_cache = _kv_block(kv)
        job.save()
        _check_kv(cfg, kv, backend)
        res.planner = _planner_block(backend, res, arch, log_text)
        lg = LoadGenerator(session, backend, observer)
        maker = await Traffic.create(backend, session, s, job.out_dir)
        res.workload = Workload.from_json(maker.describe())
        job.save()
        sampler = MemorySampler(server.process.pid if server else None, cfg.gpu.index, cfg.gpu.sample_interval_s)
        sampler.start()
        gauges = TelemetrySampler(backend, backend.base_url, headers, cfg.backend.telemetry_interval_s)
        gauges.start()
        try:
            tw = time.monotonic()
            if s.warmup_requests:
                warm = (await maker.level(s.warmup_requests, level=0, repeat=0, warmup=True)).requests
                await lg.closed_loop(warm, min(s.warmup_requests, max(s.concurrency or [1])))
                write_jsonl(job.out_dir / REQUESTS_FILE, (r.to_json() for _, r in warm))
            timing.warmup_s = round(time.monotonic() - tw, 3)
            tm = time.monotonic()
            obj = search.objectives(s)
            searcher = search.Search(obj, search.scenario_grid(s), lambda: res.levels) if obj else None
            for kind, value in searcher or job.plan:
                # the repeats an earlier run of this job finished are kept (resume)
                for repeat in range(len(job.kept.get(value, [])), s.repeats):
                    raise_if_interrupted()
                    _check_alive(server)
                    if server is None:
                        await _check_attached(backend, session)
                    log_at = server.process.log_mark() if server else None
                    level = await _run_level(job, backend, session, lg, maker, sampler, gauges, kind, value,
                                             repeat, observer)
                    if level.status == "ok" and (lost := backend.model_lost(_log_since(server, log_at))):
                        level.status, level.status_reason = "failed", (f"the server lost its model during this "
                                                                       f"level: {lost}; its figures mix two loads")
                    job.add_level(level)
                    if observer:  # once it is saved: a signal after its line loses nothing the line showed
                        observer.level_done(value, level)
                    _check_alive(server)  # a server that died says so, rather than that it stopped answering
                    raise_if_hung(level)
            _check_alive(server)
            timing.measure_s = round(time.monotonic() - tm, 3)
            if searcher is not None and searcher.step is not None:
                res.search = Search.from_json(search.result_block(searcher.step, obj, searcher.candidates,
                                                                  timing.measure_s))
        finally:
            sampler.stop()
            gauges.stop()


async def _sample(backend: Adapter, session: aiohttp.ClientSession) -> Any:
    """One direct poll of the server's gauges and counters (a level's preemptions are their difference)."""
    try:
        return await backend.poll(session)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, BackendError):
        return None


async def _run_level(job: Job, backend: Adapter, session: aiohttp.ClientSession, lg: LoadGenerator,
                     maker: Traffic, sampler: MemorySampler, gauges: TelemetrySampler, kind: str,
                     value: float, repeat: int, observer: Optional[Observer]) -> Level:
    s, client = job.cfg.scenario, job.cfg.client
    work = await maker.level(s.requests, value, repeat)
    reqs = work.requests
    options = ClientOptions(base_url=backend.base_url,
                            max_connections=client_connections(s),
                            request_timeout_s=s.request_timeout_s, stall_timeout_s=s.stall_timeout_s,
                            headers=dict(session.headers) or None, workers=client.workers,
                            event_loop=client.event_loop)
    server_writes = process_tree_writes(sampler.pid)  # a coarser sign: its log lines, for worker processes' reads
    watch = ServerWatch(session, backend.watch_path or backend.health_path, s.stall_timeout_s,  # quiet from now
                        [lambda: lg.reads, lambda: server_writes() if lg.from_workers else None,
                         continued])  # (kvexp's own pause, Ctrl-Z, is no server's silence)
    paused = continued()
    cache_reset = await _reset_cache(backend, session) if scenario.resets_cache(s) else None
    counters_before = await watch.sample(backend.server_counters(session))
    before = await watch.sample(_sample(backend, session))
    sampler.window()
    gauges.window()
    cpu_before = machine.cpu_times()
    if observer:
        observer.level_started(value, work.size, repeat)
    hung = None
    try:
        if work.conversations:
            level_run = lg.run_conversations(work.conversations, int(value))
        elif kind == "concurrency":
            level_run = lg.run_level(reqs, concurrency=int(value), max_start_rate=s.max_start_rate, options=options)
        else:
            offsets = work.offsets_s or arrival_offsets(len(reqs), value, s.arrival, s.seed + repeat)
            level_run = lg.run_level(reqs, offsets_s=offsets, max_concurrency=s.max_concurrency,
                                     max_start_rate=s.max_start_rate, options=options)
        run = await watch.guard(level_run)
        if lg.refused is not None:  # the level stopped sending at a refused connection: is the port shut?
            hung = await watch.refusal(lg.refused)
    except ServerHung as e:
        hung, run = str(e), hung_level_run(reqs, e)
    if continued() != paused:  # kvexp was stopped mid-level: nothing it timed, or found quiet, is the server's
        hung = ("kvexp itself was stopped (Ctrl-Z or SIGSTOP) and continued during this level: its timings "
                "include the pause")
    records = run.records
    load = machine.load_view(cpu_before, machine.cpu_times())
    seen = gauges.window()
    # a hung server would not answer
    after = None if hung else await _sample(backend, session)
    counters_after = None if hung else await backend.server_counters(session)
    mem = sampler.window()
    write_jsonl(job.out_dir / REQUESTS_FILE, (r.to_json() for r in records))

    summary = stats.summarize_level(records)
    level = Level(
        concurrency=int(value) if kind == "concurrency" else None,
        rate=value if kind == "rate" else None,
        repeat=repeat,
        status="ok",
        **summary,
        peak_vram_gib=_gib(mem.device_used_bytes),
        peak_server_gpu_gib=_gib(mem.server_gpu_bytes),
        peak_rss_gib=_gib(mem.server_rss_bytes),
        peak_kv_cache_usage=None if seen.peak_kv_usage is None else round(seen.peak_kv_usage, 4),
        kv_usage_samples=seen.samples,
        preemptions=_delta(before, after),
        max_running=seen.max_running,
        max_waiting=seen.max_waiting,
        loop_lag_p99_ms=run.loop_lag_p99_ms,
        client_workers=run.workers,
        client_cpu_util=max(run.cpu_util, default=None),
        goodput_req_s=stats.goodput(records, s.slo_ttft_ms, s.slo_tpot_ms, summary["wall_s"]),
    )
    if kind == "rate":
        level.achieved_rate = stats.start_rate(records)
        level.scheduled_rate = stats.start_rate(records, scheduled=True)
    level.machine = load
    level.server = backend.server_view(records, counters_before, counters_after)
    level.delivery = stats.delivery(records)
    level.peak_kv_cache_usage, level.kv_usage_sampled_peak = kv_peak(level.peak_kv_cache_usage, level.preemptions)
    bursts = bool(level.value("delivery.bursts"))
    limits = stats.client_limits(run.loop_lag_p99_ms, None if bursts else level.itl_p50_ms, run.cpu_util)
    level.client_limited = bool(limits)
    if hung:
        level.status, level.status_reason = "failed", hung
    elif level.requests and level.errors / level.requests > s.max_error_rate:
        level.status = "failed"
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(level.errors_by_kind.items()))
        first = next((r.error for r in records if r.error), "")
        level.status_reason = f"{level.errors}/{level.requests} requests failed ({kinds}); first: {first}"[:500]
    if repeat == s.repeats - 1 and s.repeats > 1:  # the last repeat sums up the level's repeats (the ok ones)
        ok = [lv for lv in job.result.levels
              if lv.value(kind) == value and (lv.repeat or 0) < repeat and lv.status == "ok"]
        level.repeats = stats.repeats_of([*ok, level] if level.status == "ok" else ok)
    level.workload = stats.workload_view(records, work.offsets_s is not None)
    level.prefix_cache = backend.prefix_cache(records, counters_before, counters_after)
    level.cache_reset = cache_reset
    level.turns = stats.turn_table(records, [backend.cached_tokens(r) for r in records]) if work.conversations else None
    done = [r for r in records if r.ok]
    level.warnings = level_warnings(level, done, backend.capabilities.forces_output_length,
                                    limits, _predicted_usage(job.result.planner, level.concurrency),
                                    _caps(s))
    level.warnings += workload_warnings(
        scenario.reuses_cache(s), cache_reset, bool(job.result.levels) or s.warmup_requests > 0,
        work.size - len(records) if work.conversations and not hung else 0,
        len(maker.entries) if s.dataset else None, s.requests)
    job.client = client_environment(run, client.workers, client.event_loop, job.client)
    job.result.environment["client"] = job.client
    return level


async def _reset_cache(backend: Adapter, session: aiohttp.ClientSession) -> dict[str, Any]:
    """Empty the server's prefix cache before a level; {done, how} (how: what was done, or why not)."""
    try:
        how = await backend.reset_cache(session)
    except (aiohttp.ClientError, asyncio.TimeoutError, BackendError) as e:
        return {"done": False, "how": f"failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"}
    return {"done": how is not None, "how": how or f"{backend.name} offers no way to reset its cache"}


def _caps(s: Any) -> Optional[str]:
    """What holds back an open loop's starts by the scenario's own choice (None: nothing)."""
    caps = [f"max_concurrency={s.max_concurrency}" if s.max_concurrency else "",
            f"max_start_rate={s.max_start_rate:g}/s" if s.max_start_rate else ""]
    held = " and ".join(c for c in caps if c)
    return f"the scenario's {held} held them back" if held else None


def _predicted_usage(plan: Optional[Plan], concurrency: Optional[int]) -> Optional[float]:
    """The planner's predicted KV usage at this concurrency, the most it can be where lengths vary (None:
    no plan or no such level)."""
    for row in plan.levels if plan is not None else []:
        if concurrency is not None and row.concurrency == concurrency:
            return row.predicted_kv_usage_max if row.predicted_kv_usage_max is not None else row.predicted_kv_usage
    return None


def _delta(before: Any, after: Any) -> Optional[float]:
    if before is None or after is None or before.preemptions_total is None or after.preemptions_total is None:
        return None
    return after.preemptions_total - before.preemptions_total


def _gib(b: Optional[int]) -> Optional[float]:
    return None if b is None else round(b / GIB, 3)


def _kv_block(kv: KVCacheInfo) -> KVCache:
    """The result's kv_cache: what the server reported of its KV cache."""
    return KVCache(dtype=kv.dtype, blocks=kv.blocks, block_size=kv.block_size,
                   gpu_memory_utilization=kv.gpu_memory_utilization, dtype_k=kv.dtype_k, dtype_v=kv.dtype_v,
                   capacity_tokens=kv.capacity_tokens, window_tokens=kv.window_tokens, bytes=kv.bytes,
                   max_concurrency=kv.max_concurrency, seqs=kv.seqs, source=kv.source,
                   rotation_k=kv.rotation_k, rotation_v=kv.rotation_v)


LOG_WAIT_S = 5.0  # how long the server's KV lines may trail its health probe's answer


def _log_since(server: Optional[Server], mark: Optional[tuple[int, int]]) -> str:
    """What the launched server wrote since mark, as far as its log keeps it (at most 4 MiB; where the cap
    dropped part of it, the lines kept whole come first); "" for an attached server."""
    return "" if server is None or mark is None else server.process.log_since(mark)


async def _server_log(backend: Adapter, server: Optional[Server]) -> str:
    """The launched server's log once it states its KV cache (its logger may write after the server
    answers its health probe), or as it is after LOG_WAIT_S; "" for an attached server."""
    if server is None:
        return ""
    deadline = time.monotonic() + LOG_WAIT_S
    while True:
        text = server.process.log_path.read_text(errors="replace")
        if backend.log_states_kv(text) or time.monotonic() > deadline or server.process.exited() is not None:
            return text
        await asyncio.sleep(0.05)


def _check_kv(cfg: ExperimentConfig, kv: KVCacheInfo, backend: Adapter) -> None:
    """A server that reports a different KV type (or KV numerics) than the ones asked for fails the job
    loudly."""
    if (contradiction := backend.check_kv(kv)) is not None:
        raise BackendError(contradiction)
    asked = cfg.kv.per_backend.get(backend.name)
    if kv.dtype is None:
        log.warning("%s did not report its KV cache type; kv=%s (%s) is what was asked, not confirmed",
                    backend.name, cfg.kv.name, asked)
        return
    if kv.dtype != asked:
        raise BackendError(f"the server reports KV cache type {kv.dtype!r} but kv={cfg.kv.name} asked for "
                           f"{asked!r} on {backend.name}")


def _model_arch(backend: Adapter) -> Optional[ModelArch]:
    """The served model's architecture and weights, from its files (None: they cannot be read)."""
    try:
        return prediction.model_arch(backend.cfg, backend.spec)
    except (ValueError, OSError) as e:
        log.warning("model files of %s not read: %s", backend.cfg.model.name, e)
        return None


def _planner_block(backend: Adapter, res: JobResult, arch: Optional[ModelArch],
                   log_text: str = "") -> Optional[Plan]:
    """The planner's prediction for the server that was launched, beside what will be measured
    (None if it cannot plan); its log so far gives the buffers it allocated at start (a CPU's RSS)."""
    try:
        return Plan.from_json(prediction.predict(backend.cfg, backend.spec, gpu_name=res.gpu.name,
                                                 gpu_gib=res.gpu.memory_gib, calibration=calibration.load(),
                                                 arch=arch, server_log=log_text or None))
    except (ValueError, OSError, KeyError, calibration.CalibrationError) as e:
        log.warning("planner: no prediction for %s: %s", res.label, e)
        return None


def _learn(res: JobResult) -> None:
    """Feed a finished job's engine-reported capacity into the calibration file."""
    try:
        calibration.update([res])
    except (ValueError, OSError, KeyError, calibration.CalibrationError) as e:
        log.warning("calibration: not updated from %s: %s", res.label, e)


def unrun_result(cfg: ExperimentConfig, out_dir: Path, reason: str, status: str = "skipped") -> JobResult:
    """A job that was not run, recorded as such: "skipped" (an unsupported backend/KV pair, see
    config.skips_unsupported) or "failed" (its scheduler never started it: a Slurm job cancelled while
    it was pending; a resume runs it)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    job = Job(cfg, out_dir, new_result(cfg, None))
    job.result.status, job.result.status_reason, job.result.finished_at = status, reason, utc_now()
    job.save()
    return job.result
