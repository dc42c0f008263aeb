"""How the report's cost grows with a sweep: realistic sweeps of 10, 100 and 1,000 jobs (bench/sweep.py:
kvexp's real results varied over KV dtypes, scenarios, 2-8 levels, requests.jsonl beside each), each
reported in this one process, then `python -m kvexp report` on the largest as a user runs it.

    python bench/report_speed.py [--runs 10 100 1000] [--dir DIR] [--no-cli] [--no-memory]

Per sweep size, in this process (imports and the schemas' compilation done before the first):
- time: `collect` (find, read and check every result, the verdicts and the ranking) plus `render_report`
  with Markdown and HTML (it always writes comparison.json and comparison.csv too), wall and CPU seconds
  (this process's and its chart workers'), in total and per run;
- memory: the peak of Python's allocations during the same work (tracemalloc, in a second pass of its
  own, since tracing slows the work it traces), in total and per run.
Then the command itself on the largest sweep, in a child process: when the last of report.md,
report.html, comparison.json and comparison.csv was written (the files' times, from the start), when the
PDF was, its CPU time (its chart and PDF workers' included) and its peak resident memory (the largest of
its processes, from its rusage, as `/usr/bin/time -v` reports it). Targets
(issue 36): MD/HTML/JSON/CSV under 10 s and 500 MB, the PDF under 30 s.

The sweeps are written once under --dir (default: $TMPDIR/kvexp-report-speed) and reused.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from kvexp.analysis.aggregate import collect  # noqa: E402
from kvexp.core import machine  # noqa: E402
from kvexp.report.render import FILES, render_report  # noqa: E402
from sweep import write_sweep  # noqa: E402

TARGET_S, TARGET_MB, TARGET_PDF_S = 10.0, 500.0, 30.0


def sweep_dir(base: Path, runs: int) -> Path:
    """The sweep of `runs` jobs under base, written the first time it is asked for."""
    d = base / f"sweep-{runs}"
    if not (d / "done").is_file():
        shutil.rmtree(d, ignore_errors=True)
        write_sweep(d, runs)
        (d / "done").write_text("")
    return d


def report_once(sweep: Path, out: Path) -> None:
    render_report(collect([sweep]), out, formats=("md", "html"))


def cpu_s() -> tuple[float, float]:
    """CPU seconds of this process, and of its children that have ended (the report's chart workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def timed(sweep: Path, out: Path) -> tuple[float, float, float]:
    """(wall s, CPU s of this process, CPU s of its chart workers) of one report."""
    gc.collect()
    w, (m, k) = time.perf_counter(), cpu_s()
    report_once(sweep, out)
    m2, k2 = cpu_s()
    return time.perf_counter() - w, m2 - m, k2 - k


def traced(sweep: Path, out: Path) -> float:
    """Peak bytes of Python allocations while the report is made (tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    try:
        report_once(sweep, out)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def cli(sweep: Path, out: Path) -> dict[str, float]:
    """`python -m kvexp report` on the sweep: seconds to its last non-PDF file and to the PDF, its exit,
    and the child's peak RSS in MB."""
    shutil.rmtree(out, ignore_errors=True)
    start = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "kvexp", "report", str(sweep), "--out", str(out)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)  # its usage includes its chart and PDF workers' (it waited for them)
    total = time.time() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.returncode != 0:
        raise SystemExit(f"kvexp report failed ({proc.returncode}): {err.strip()[-500:]}")
    files = {k: out / name for k, name in FILES.items()}
    text_done = max(files[k].stat().st_mtime for k in ("md", "html", "json", "csv")) - start
    pdf_done = files["pdf"].stat().st_mtime - start if files["pdf"].is_file() else None
    return {"text_s": text_done, "pdf_s": pdf_done, "total_s": total, "rss_mb": usage.ru_maxrss / 1024,
            "cpu_s": usage.ru_utime + usage.ru_stime,
            "pdf_bytes": files["pdf"].stat().st_size if files["pdf"].is_file() else 0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "kvexp-report-speed")
    ap.add_argument("--no-cli", action="store_true", help="skip `python -m kvexp report` on the largest sweep")
    ap.add_argument("--no-memory", action="store_true", help="skip the tracemalloc pass")
    args = ap.parse_args(argv)
    sweeps = {n: sweep_dir(args.dir, n) for n in args.runs}
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{machine.usable_cpus()} CPUs, load average {load} before; python {sys.version.split()[0]}")
    report_once(sweeps[min(sweeps)], args.dir / "warm")  # imports, the schemas' compilation, fonts
    print("CPU: this process + its chart workers; idle bound: the wall time two idle CPUs need at least, "
          "max(this process, all / 2)")
    print(f"{'runs':>6} {'wall s':>8} {'CPU s':>14} {'idle bound s':>12} {'ms/run':>8} {'CPU ms/run':>11} "
          f"{'peak MB':>8} {'KB/run':>8}")
    for n, sweep in sweeps.items():
        wall, main_cpu, workers_cpu = timed(sweep, args.dir / f"report-{n}")
        cpu = main_cpu + workers_cpu
        peak = None if args.no_memory else traced(sweep, args.dir / f"report-{n}")
        mem = "" if peak is None else f"{peak / 1e6:8.1f} {peak / 1e3 / n:8.1f}"
        print(f"{n:6d} {wall:8.2f} {cpu:6.2f} ({main_cpu:5.2f}) {max(main_cpu, cpu / 2):12.2f} "
              f"{1000 * wall / n:8.1f} {1000 * cpu / n:11.1f} {mem}", flush=True)
    if not args.no_cli:
        n = max(sweeps)
        r = cli(sweeps[n], args.dir / f"cli-{n}")
        pdf = "no PDF (WeasyPrint missing)" if r["pdf_s"] is None else \
            f"PDF at {r['pdf_s']:.2f} s ({r['pdf_bytes'] / 1e6:.1f} MB; target < {TARGET_PDF_S:g} s)"
        print(f"python -m kvexp report, {n} runs: MD/HTML/JSON/CSV written at {r['text_s']:.2f} s "
              f"(target < {TARGET_S:g} s), {pdf}, exit at {r['total_s']:.2f} s, "
              f"peak RSS {r['rss_mb']:.0f} MB (target < {TARGET_MB:g} MB; the largest of its processes); "
              f"CPU {r['cpu_s']:.2f} s (with its workers')")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average {load} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
