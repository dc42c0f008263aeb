"""How long the report takes for a large sweep: a synthetic 100-run aggregate derived from the reference
document (its runs repeated with varied labels and slightly scaled numbers), rendered as Markdown,
HTML and PDF. Prints the seconds for each step and the total; the target is under 10 s.

    python bench/report_speed.py [--runs 100] [--reference PATH] [--out DIR] [--keep]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvexp.core import machine  # noqa: E402
from kvexp.report import pdf
from kvexp.report import render as R  # noqa: E402

REFERENCES = (ROOT / "tests" / "fixtures" / "rtx5070ti-qwen2.5-7b.json",
              ROOT.parent / "shared" / "reference" / "rtx5070ti-qwen2.5-7b.json")
SCALED = ("throughput_tok_s", "ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms")


def synthetic(reference: dict, n: int) -> dict:
    """n runs cycling over the reference's runs; run i gets the label suffix -v<i> and its latency and
    throughput figures scaled by a deterministic factor between 0.90 and 1.10."""
    agg = copy.deepcopy(reference)
    base = reference["runs"]
    runs = []
    for i in range(n):
        run = copy.deepcopy(base[i % len(base)])
        run["label"] = f"{run['label']}-v{i // len(base)}"
        factor = 0.90 + 0.20 * ((i * 37) % 101) / 100
        for lv in run["levels"]:
            for k in SCALED:
                if lv.get(k) is not None:
                    lv[k] = round(lv[k] * factor, 2)
        runs.append(run)
    agg["runs"] = runs
    return agg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--reference", type=Path, default=next((p for p in REFERENCES if p.is_file()), REFERENCES[0]))
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: a temporary one)")
    args = ap.parse_args(argv)
    agg = synthetic(json.loads(args.reference.read_text()), args.runs)
    out = args.out or Path(tempfile.mkdtemp(prefix="kvexp-report-speed-"))
    levels = sum(len(r["levels"]) for r in agg["runs"])

    def timed(fn):  # wall and CPU seconds: on a shared machine the CPU figure is the steadier one
        w, c = time.perf_counter(), time.process_time()
        result = fn()
        return result, time.perf_counter() - w, time.process_time() - c

    _, w1, c1 = timed(lambda: R.render_report(agg, out / "md-html", formats=("md", "html")))
    files, w2, c2 = timed(lambda: R.render_report(agg, out / "all"))
    if "pdf" not in files:
        print(f"PDF skipped: {'; '.join(files.problems)}")
        return 1
    html = (out / "all" / "report.html").read_text()
    _, w3, c3 = timed(lambda: pdf.write(html, out / "pdf-one-process.pdf", out / "all", workers=1))
    _, w4, c4 = timed(lambda: pdf.write(html, out / "pdf-parallel.pdf", out / "all"))
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{args.runs} runs, {levels} levels -> {out}   ({machine.usable_cpus()} CPUs, load average {load})")
    print("CPU: this process only; the parallel PDF's workers are not counted")
    print(f"md+html                  {w1:6.2f} s wall  {c1:6.2f} s CPU")
    print(f"pdf alone, one process   {w3:6.2f} s wall  {c3:6.2f} s CPU")
    print(f"pdf alone, parallel      {w4:6.2f} s wall  {c4:6.2f} s CPU")
    print(f"md+html+pdf (default)    {w2:6.2f} s wall  {c2:6.2f} s CPU   (target < 10 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
