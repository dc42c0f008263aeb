"""A realistic sweep folder of N kvexp jobs, built from real results, for the report's benchmark and its
per-run cost test.

    python bench/sweep.py OUT_DIR [--runs 1000] [--seed 0]

Every job folder is what a Hydra multirun of `python -m kvexp` leaves (`<n>_<label>/` with `.hydra/`,
`result.json`, `requests.jsonl`, `summary.md`). Each result starts from one of kvexp's real result
fixtures (llama-server on SmolLM2-135M: the smoke and cpu scenarios, fp16, q8_0 and K q8_0/V q4_0; vLLM's
CPU build on the tiny Qwen2) and is varied the way a cluster sweep varies:
- the KV dtype among those its backend accepts, every field that names it (kv, kv_cache, server, config,
  launch command, planner bytes) kept consistent;
- one of eight scenarios (prompt and output lengths from 32+16 to 8,192+256 tokens);
- 2 to 8 concurrency levels (1, 2, 4, ... 128), each with its own request count (the scenario's, or
  four per concurrent stream when more), its figures scaled from the real level as a server saturates
  (throughput grows sub-linearly, TTFT with the queue, TPOT slowly);
- a threads setting and a seed, which name the run (label and config) so that every run is distinct;
- about 3 % partial runs (the last level failed on timeouts) and 1 % skipped ones (no levels).
requests.jsonl holds one line per measured request (and the warm-up requests), with per-token times, as
the load generator writes them. Deterministic for a given --seed.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
TEMPLATES = (FIXTURES / "decision" / "fp16" / "result.json", FIXTURES / "decision" / "q8_0" / "result.json",
             FIXTURES / "decision" / "cpu-fp16" / "result.json",
             FIXTURES / "decision" / "cpu-q8_0-q4_0" / "result.json", FIXTURES / "foreign" / "kvexp" / "result.json")

# KV dtypes a backend accepts: (requested name, backend's name, bytes per element, K type, V type)
KV = {
    "llamacpp": (("fp16", "f16", 2.0, "f16", "f16"), ("q8_0", "q8_0", 1.0625, "q8_0", "q8_0"),
                 ("q4_0", "q4_0", 0.5625, "q4_0", "q4_0"), ("q8_0/q4_0", "q8_0/q4_0", 0.8125, "q8_0", "q4_0")),
    "vllm": (("fp16", "auto", 2.0, None, None), ("fp8", "fp8", 1.0, None, None)),
}
# scenario: (prompt tokens, output tokens, requests per level)
SCENARIOS = {"smoke": (32, 16, 8), "cpu": (128, 64, 20), "chat": (512, 128, 32), "code": (1024, 256, 24),
             "rag": (2048, 128, 32), "agent": (1024, 32, 48), "summarise": (4096, 256, 16),
             "long-context": (8192, 64, 16)}
sys.path.insert(0, str(ROOT))
from kvexp.results.validate import config_hash  # noqa: E402

LADDER = (1, 2, 4, 8, 16, 32, 64, 128)
LATENCY = ("ttft", "e2e", "client_queue")


def _templates() -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in TEMPLATES]


def _kv_name(requested: str) -> str:
    return requested.replace("/", "_")


def _set_kv(res: dict[str, Any], kv: tuple) -> None:
    requested, backend_dtype, bpe, k, v = kv
    old_bpe = res["kv"]["bytes_per_element"]
    res["kv"] = {"requested": requested, "backend_dtype": backend_dtype, "bytes_per_element": bpe}
    server = res.get("server") or {}
    if server:
        server.update(kv_dtype=requested, kv_backend_dtype=backend_dtype, kv_bytes_per_element=bpe)
    cache = res["kv_cache"]
    cache["dtype"] = backend_dtype
    if k is not None and "dtype_k" in cache:
        cache["dtype_k"], cache["dtype_v"] = k, v
    if cache.get("bytes") is not None:
        cache["bytes"] = int(cache["bytes"] * bpe / old_bpe)
    res["config"]["kv"] = {"name": requested, "per_backend": {res["backend"]["name"]: backend_dtype}}
    cmd = res["backend"].get("launch_command") or []
    for flag, value in (("-ctk", k), ("-ctv", v), ("--kv-cache-dtype", backend_dtype)):
        if flag in cmd and value is not None:
            cmd[cmd.index(flag) + 1] = value
    planner = res.get("planner") or {}
    for key in ("kv_bytes_per_element",):
        if planner.get(key) is not None:
            planner[key] = bpe
    for key in ("kv_bytes_per_token", "kv_cache_bytes"):
        if planner.get(key) is not None:
            planner[key] = int(planner[key] * bpe / old_bpe)


def _scaled(base: dict[str, Any], c: int, requests: int, prompt: int, output: int, rng: random.Random,
            speed: float) -> dict[str, Any]:
    """A level at concurrency c from a real level at concurrency 1: a server that saturates."""
    lv = copy.deepcopy(base)
    queue = 1 + 0.35 * (c - 1)  # TTFT grows with the queue
    decode = 1 + 0.06 * (c - 1) ** 0.8  # TPOT slowly
    tput = c ** 0.72 * speed * rng.uniform(0.95, 1.05)
    lv.update(concurrency=c, repeat=0, status="ok", requests=requests, errors=0, errors_by_kind={})
    for key, value in list(lv.items()):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value is None:
            continue
        if key.endswith("_ms"):
            grow = queue if key.startswith(LATENCY) else decode
            lv[key] = round(value * grow / speed * rng.uniform(0.97, 1.03), 3)
    # percentiles stay ordered after the jitter
    for metric in ("ttft", "tpot", "itl", "e2e"):
        ps = [lv.get(f"{metric}_p{p}_ms") for p in (50, 95, 99)]
        if all(isinstance(x, (int, float)) for x in ps):
            for p, x in zip((50, 95, 99), sorted(ps)):
                lv[f"{metric}_p{p}_ms"] = x
    for key in ("throughput_tok_s", "request_rate"):
        if lv.get(key) is not None:
            lv[key] = round(lv[key] * tput, 3)
    lv["output_tokens"] = requests * output
    lv["mean_prompt_tokens"], lv["mean_output_tokens"] = float(prompt), float(output)
    lv["wall_s"] = round(requests * output / max(lv.get("throughput_tok_s") or 1.0, 1e-3), 3)
    if lv.get("peak_kv_cache_usage") is not None:
        lv["peak_kv_cache_usage"] = round(min(1.0, lv["peak_kv_cache_usage"] * c * (prompt + output) / 48), 4)
    lv["max_running"], lv["max_waiting"] = c, 0
    if isinstance(lv.get("server"), dict) and "requests" in lv["server"]:
        lv["server"]["requests"] = requests
    if isinstance(lv.get("delivery"), dict) and lv["delivery"].get("chunks") is not None:
        lv["delivery"]["chunks"] = requests * output
    w = lv.get("workload")
    if isinstance(w, dict):
        for key, tokens in (("prompt_tokens", prompt), ("output_tokens", output)):
            for side in ("asked", "realised"):
                if isinstance((w.get(key) or {}).get(side), dict):
                    w[key][side] = {"n": requests, "mean": float(tokens), "p50": float(tokens), "p99": float(tokens),
                                    "min": tokens, "max": tokens}
        if "prompts_exact" in w:
            w["prompts_exact"] = w["prompts_checked"] = requests
        if "prompt_histogram" in w:
            w["prompt_histogram"] = [{"lo": prompt, "hi": prompt, "count": requests}]
    if isinstance(lv.get("prefix_cache"), dict) and lv["prefix_cache"].get("queried_tokens") is not None:
        lv["prefix_cache"].update(queried_tokens=requests * prompt, hit_tokens=0, hit_rate=0.0)
    warnings = [wn for wn in lv.get("warnings") or []
                if not (wn.get("code") == "few_requests" if isinstance(wn, dict) else "requests:" in wn)]
    if requests < 20 and all(isinstance(wn, dict) for wn in lv.get("warnings") or [{}]):
        warnings.append({"code": "few_requests", "text": f"only {requests} requests: percentiles are rough",
                         "values": {"requests": requests, "min_requests": 20}})
    lv["warnings"] = warnings
    lv.pop("repeats", None)
    return lv


def _request_lines(res: dict[str, Any], rng: random.Random) -> str:
    """requests.jsonl: the warm-up requests, then each level's measured requests, timed as its figures say."""
    prompt, output = res["scenario"]["prompt_tokens"], res["scenario"]["max_tokens"]
    out, t, index = [], 0.0, 0

    def line(level: float, warmup: bool, ttft_s: float, tpot_s: float, failed: bool) -> str:
        nonlocal t, index
        sent = t
        first = None if failed else sent + ttft_s
        times = [] if failed else [round(first + i * tpot_s * rng.uniform(0.9, 1.1), 5) for i in range(output)]
        row = {"index": index, "level": level, "repeat": 0, "warmup": warmup, "scheduled_s": None,
               "sent_s": round(sent, 5), "first_token_s": None if failed else round(first, 5),
               "done_s": round(times[-1] if times else sent + 60.0, 5), "token_times_s": times,
               "target_prompt_tokens": prompt, "max_tokens": output, "prompt_tokens": prompt,
               "output_tokens": None if failed else output, "finish_reason": None if failed else "length",
               "http_status": None if failed else 200, "error_kind": "timeout" if failed else None,
               "error": "no token within 60 s" if failed else None,
               "server_timings": None if failed else {"prompt_ms": round(ttft_s * 900, 3),
                                                      "predicted_per_token_ms": round(tpot_s * 1000, 3),
                                                      "cache_n": 0}}
        index += 1
        t += ttft_s / 2
        return json.dumps(row)

    for lv in res["levels"]:
        c = lv["concurrency"]
        ttft, tpot = (lv.get("ttft_p50_ms") or 100.0) / 1000, (lv.get("tpot_p50_ms") or 20.0) / 1000
        out.append(line(float(c), True, ttft, tpot, False))
        for i in range(lv["requests"]):
            out.append(line(float(c), False, ttft * rng.uniform(0.8, 1.2), tpot, i < lv["errors"]))
    return "\n".join(out) + "\n" if out else ""


def job(templates: list[dict[str, Any]], i: int, seed: int = 0) -> tuple[dict[str, Any], str]:
    """Job i of the sweep: (its result, its requests.jsonl text)."""
    rng = random.Random(seed * 1_000_003 + i)
    res = copy.deepcopy(templates[i % len(templates)])
    backend = res["backend"]["name"]
    kvs = KV[backend]
    kv = kvs[(i // len(templates)) % len(kvs)]
    scenario = list(SCENARIOS)[(i // (len(templates) * len(kvs))) % len(SCENARIOS)]
    threads, run_seed = 1 + i % 4, i // 4
    prompt, output, per_level = SCENARIOS[scenario]
    _set_kv(res, kv)
    model = res["model"]["name"]
    res["label"] = f"{backend}-{model}-{_kv_name(kv[0])}-{scenario}-t{threads}-s{run_seed}"
    res["scenario"].update(name=scenario, prompt_tokens=prompt, max_tokens=output)
    cs = res["config"]["scenario"]
    cs.update(name=scenario, prompt_tokens=prompt, max_tokens=output)
    res["config"]["backend"]["threads"] = threads
    res["config"]["seed"] = run_seed
    if isinstance(res.get("workload"), dict):
        for key, tokens in (("prompt_dist", prompt), ("output_dist", output)):
            if isinstance(res["workload"].get(key), dict):
                res["workload"][key].update(centre=tokens, mean=float(tokens))
    n_levels = 2 + rng.randrange(7)
    base = res["levels"][0]
    speed = rng.uniform(0.6, 1.6) * (32 / (prompt + output)) ** 0.3
    res["levels"] = [_scaled(base, c, max(per_level, 4 * c), prompt, output, rng, speed) for c in LADDER[:n_levels]]
    cs["concurrency"] = list(LADDER[:n_levels])
    if res.get("server"):
        res["server"]["slots"] = LADDER[n_levels - 1]
    day, minute = 7 + i // 1440, i % 1440
    res["started_at"] = f"2026-12-{day:02d}T{minute // 60:02d}:{minute % 60:02d}:00Z"
    res["finished_at"] = f"2026-12-{day:02d}T{minute // 60:02d}:{minute % 60:02d}:50Z"
    roll = rng.random()
    if roll < 0.01:  # a pair the backend refuses: recorded, never run
        res.update(status="skipped", levels=[], quality=None,
                   status_reason=f"kv={kv[0]} with threads={threads} is not supported by this {backend} build")
        res.pop("quality", None)
    elif roll < 0.04:  # the last level timed out
        last = res["levels"][-1]
        last["errors"] = last["requests"] // 2
        last["errors_by_kind"] = {"timeout": last["errors"]}
        last["status"] = "failed"
        last["status_reason"] = (f"{last['errors']}/{last['requests']} requests failed (timeout {last['errors']}); "
                                 "first: no token within 60 s")
        res["status"] = "partial"
        res["status_reason"] = "1 level(s) failed: " + last["status_reason"]
    res["config_hash"] = config_hash(res["config"])
    return res, _request_lines(res, rng)


def write_sweep(out: Path, runs: int, seed: int = 0, requests: bool = True) -> dict[str, int]:
    """Write a sweep of `runs` job folders under out; returns counts (runs, levels, requests, bytes).
    requests=False: no requests.jsonl (a test of the report, which never opens them, writes less)."""
    templates = _templates()
    out.mkdir(parents=True, exist_ok=True)
    (out / "multirun.yaml").write_text("hydra:\n  mode: MULTIRUN\n")
    counts = {"runs": runs, "levels": 0, "requests": 0, "bytes": 0}
    for i in range(runs):
        res, lines = job(templates, i, seed)
        d = out / f"{i}_{res['label']}"
        (d / ".hydra").mkdir(parents=True, exist_ok=True)
        (d / ".hydra" / "overrides.yaml").write_text(
            f"- kv={res['kv']['requested']}\n- scenario={res['scenario']['name']}\n"
            f"- backend.threads={res['config']['backend']['threads']}\n- seed={res['config']['seed']}\n")
        (d / ".hydra" / "config.yaml").write_text(f"label: {res['label']}\n")
        text = json.dumps(res, indent=1) + "\n"
        (d / "result.json").write_text(text)
        if requests:
            (d / "requests.jsonl").write_text(lines)
        else:
            lines = ""
        (d / "summary.md").write_text(f"# {res['label']}\n")
        counts["levels"] += len(res["levels"])
        counts["requests"] += lines.count("\n")
        counts["bytes"] += len(text) + len(lines)
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    c = write_sweep(args.out, args.runs, args.seed)
    print(f"{c['runs']} runs, {c['levels']} levels, {c['requests']:,} request lines, "
          f"{c['bytes'] / 2**20:.1f} MiB -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
