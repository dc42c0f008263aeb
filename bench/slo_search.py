"""The SLO search against the full grid on the real llama-server (the tiny model kvexp writes itself,
on the CPU): both find the highest concurrency whose TTFT p95 meets the objective; this prints each
one's answer, the levels it measured and its measurement time (result timing.measure_s), per round.

    python bench/slo_search.py [--rounds 3] [--slo-ttft-ms 150] [--json OUT]

The scenario puts the answer inside the grid: 4 slots (-np 4), 16 requests of 32 + 512 tokens per
level, concurrency 1..16; up to 4 streams no request waits for a slot, from 5 on requests wait for a
whole 512-token request. Both jobs share one server (kvexp's server pool), grid first."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvexp.metrics import search  # noqa: E402
from kvexp.app.compose import compose  # noqa: E402
from kvexp.assets.install import find_llama_server  # noqa: E402
from kvexp.measure.runner import ServerPool, run_job  # noqa: E402

GRID = "[" + ",".join(str(c) for c in range(1, 17)) + "]"


def one_round(binary: Path, slo_ms: float, out: Path, pool: ServerPool) -> dict:
    base = ["scenario=smoke", f"scenario.concurrency={GRID}", "scenario.requests=16", "scenario.max_tokens=512",
            "backend.parallel=4", f"scenario.slo_ttft_ms={slo_ms}", f"backend.binary={binary}"]
    grid = run_job(compose([*base, "label=grid"]), out / "grid", pool=pool)
    found = run_job(compose([*base, "label=search", "scenario.search=concurrency",
                             "scenario.search_min_growth=null"]), out / "search", pool=pool)
    obj = search.Objectives("concurrency", slo_ms, None)
    probes = [search.evaluate(lv.concurrency, [lv], obj) for lv in grid.levels]
    return {"grid_answer": search.grid_answer(probes), "grid_levels": len(grid.levels),
            "grid_measure_s": grid.timing["measure_s"],
            "search_answer": found.search["answer"], "search_levels": len(found.levels),
            "search_order": [p["x"] for p in found.search["probed"]],
            "search_stop": found.search["stop_reason"], "search_measure_s": found.timing["measure_s"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--slo-ttft-ms", type=float, default=150.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    binary = find_llama_server()
    if binary is None:
        print("bench/slo_search.py: llama-server is not installed: run `python -m kvexp install llamacpp`",
              file=sys.stderr)
        return 1
    print("command: python bench/slo_search.py " + " ".join(sys.argv[1:]))
    print(f"load average before: {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs")
    rows, pool = [], ServerPool()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.rounds):
                r = one_round(binary, args.slo_ttft_ms, Path(tmp) / str(i), pool)
                rows.append(r)
                share = r["search_measure_s"] / r["grid_measure_s"] * 100
                print(f"round {i + 1}: grid answer {r['grid_answer']:g} from {r['grid_levels']} levels in "
                      f"{r['grid_measure_s']:.1f} s; search answer {r['search_answer']:g} from {r['search_levels']} "
                      f"levels {r['search_order']} in {r['search_measure_s']:.1f} s ({share:.0f} % of the grid's time), "
                      f"stopped: {r['search_stop']}")
    finally:
        pool.release()
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(r["grid_answer"] == r["search_answer"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
