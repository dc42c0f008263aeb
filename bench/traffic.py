"""The user's own traffic on the real llama-server (the tiny model kvexp writes itself, on the CPU), per
round: a trace replayed at several time scales (how far each request was sent from its time in the
trace: p50, p99, max ms), an open-loop level of 20 requests/s, Poisson, beside its server with the
client on CPUs of its own and on shared ones (client.placement=split, shared; client queue p50, p99: how
late kvexp's client sent; the target is a p99 under 5 ms), the share of a second spent yielding before
scheduled starts at 2,000 starts a second (target: SPIN_SHARE plus the few waiters that overlap it),
and shared prefixes against the same lengths without (TTFT p50, the prefix cache's hit rate).

    python bench/traffic.py [--rounds 3] [--scales 1 0.5 0.25] [--json OUT]

The trace is kvexp's own (kvexp/datasets/trace-tiny.jsonl: 64 rows, 8 requests/s, 16-token blocks);
the prefix scenario is conf/scenario/prefix.yaml (512-token prompts, 2 shared prefixes of 384 tokens,
32 output tokens, concurrency 1 and 4, 24 requests per level)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvexp.app.compose import compose  # noqa: E402
from kvexp.assets.install import find_llama_server  # noqa: E402
from kvexp.measure.runner import ServerPool, run_job  # noqa: E402


def trace_round(binary: Path, scales: list[float], out: Path, pool: ServerPool) -> list[dict]:
    rows = []
    for scale in scales:
        res = run_job(compose(["scenario=trace", f"scenario.time_scale={scale}", f"backend.binary={binary}"]),
                      out / f"trace-{scale}", pool=pool).to_json()
        (lv,) = res["levels"]
        rows.append({"time_scale": scale, "rate": lv["rate"], "errors": lv["errors"],
                     **{f"arrival_{k}_ms": v for k, v in lv["workload"]["arrival_error_ms"].items()},
                     "hit_rate": lv["prefix_cache"]["hit_rate"] if lv["prefix_cache"] else None})
    return rows


def open_round(binary: Path, out: Path, pool: ServerPool, placement: str) -> dict:
    """tests/integration/llamacpp/test_truth_llamacpp.py's open-loop level, on the job's own event loop, beside its
    server: client.placement=shared (both anywhere) or split (each on CPUs of its own)."""
    res = run_job(compose(["model=tiny", "scenario=smoke", "scenario.concurrency=[]", "scenario.rates=[20.0]",
                           "scenario.arrival=poisson", "scenario.requests=60", "backend.parallel=16",
                           "client.workers=1", f"client.placement={placement}", f"backend.binary={binary}"]),
                  out, pool=pool).to_json()
    (lv,) = res["levels"]
    return {"placement": placement, **{k: lv[k] for k in (
        "scheduled_rate", "achieved_rate", "client_queue_p50_ms", "client_queue_p99_ms", "loop_lag_p99_ms", "errors")}}


def spin_round() -> dict:
    """1,900 starts due in under a second, each waiter yielding its last SPIN_S
    (tests/unit/measure/test_loadgen_waits.py)."""
    import asyncio

    from kvexp.measure import loadgen

    class Streamer:
        stream_keepalive = True

    async def run() -> float:
        lg = loadgen.LoadGenerator(None, Streamer())  # type: ignore[arg-type]
        start = lg.now() + 0.01
        await asyncio.gather(*(lg.until(start + i / 2000) for i in range(1900)))
        return lg.spun_s

    return {"yielded_s": round(asyncio.run(run()), 3),
            "target_s": round(loadgen.SPIN_SHARE + 8 * loadgen.SPIN_S, 3)}


def prefix_round(binary: Path, out: Path, pool: ServerPool) -> list[dict]:
    runs = {name: run_job(compose(["scenario=prefix", f"backend.binary={binary}", *extra]), out / name,
                          pool=pool).to_json()
            for name, extra in (("shared", []), ("unique", ["scenario.prefix_tokens=0"]))}
    return [{"concurrency": s["concurrency"], "ttft_p50_ms_shared": s["ttft_p50_ms"],
             "ttft_p50_ms_unique": u["ttft_p50_ms"], "hit_rate_shared": s["prefix_cache"]["hit_rate"],
             "hit_rate_unique": u["prefix_cache"]["hit_rate"]}
            for s, u in zip(runs["shared"]["levels"], runs["unique"]["levels"])]


PARTS = ("trace", "open", "spin", "prefix")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scales", type=float, nargs="+", default=[1.0, 0.5, 0.25])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS), help="the parts to run (default: all)")
    args = ap.parse_args()
    binary = find_llama_server()
    if binary is None:
        print("bench/traffic.py: llama-server is not installed: run `python -m kvexp install llamacpp`",
              file=sys.stderr)
        return 1
    print("command: python bench/traffic.py " + " ".join(sys.argv[1:]))
    print(f"load average before: {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs")
    out: dict[str, list] = {"trace": [], "open": [], "spin": [], "prefix": []}
    pool = ServerPool()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for n in range(args.rounds):
                for row in trace_round(binary, args.scales, Path(tmp) / f"r{n}", pool) if "trace" in args.only else ():
                    out["trace"].append({"round": n + 1, **row})
                    print("trace  round {round}: x{time_scale:g} ({rate:g} req/s): arrival error p50 "
                          "{arrival_p50_ms:.2f} / p99 {arrival_p99_ms:.2f} / max {arrival_max_ms:.2f} ms, "
                          "{errors} errors, hit rate {hit_rate}".format(**out["trace"][-1]))
                for placement in ("shared", "split") if "open" in args.only else ():
                    row = open_round(binary, Path(tmp) / f"o{n}-{placement}", pool, placement)
                    out["open"].append({"round": n + 1, **row})
                    print("open   round {round} ({placement}): 20 req/s Poisson: achieved {achieved_rate} of "
                          "{scheduled_rate} req/s, client queue p50 {client_queue_p50_ms} / p99 {client_queue_p99_ms} "
                          "ms, loop lag p99 {loop_lag_p99_ms} ms, {errors} errors".format(**out["open"][-1]))
                if "spin" in args.only:
                    out["spin"].append({"round": n + 1, **spin_round()})
                    print("spin   round {round}: 1,900 starts in under a second: yielded {yielded_s} s "
                          "(target <= {target_s} s)".format(**out["spin"][-1]))
                for row in prefix_round(binary, Path(tmp) / f"p{n}", pool) if "prefix" in args.only else ():
                    out["prefix"].append({"round": n + 1, **row})
                    print("prefix round {round}: c={concurrency}: TTFT p50 {ttft_p50_ms_shared} ms shared vs "
                          "{ttft_p50_ms_unique} ms unique; hit rate {hit_rate_shared} vs {hit_rate_unique}"
                          .format(**out["prefix"][-1]))
    finally:
        pool.release()
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
