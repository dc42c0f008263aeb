"""The conditions two runs were measured under, and whether they differ enough that a difference
between their figures cannot be credited to the configurations: the machine's load while each level
ran (level.machine: load average, CPU steal), and what each server ran (engine build, weights).

A comparison across runs whose machine load differed is never called measurable (noise.compare); one
across engines or weights says which, so a reader sees what the figures compare. Pure."""

from __future__ import annotations

from typing import Optional

from kvexp.results.runs import Run

# Two runs' machine conditions differ when their CPU steal differs by more than this share of CPU time,
# or their load average per core by more than LOAD_PER_CORE_DIFF.
STEAL_DIFF = 0.05
LOAD_PER_CORE_DIFF = 0.5

Load = tuple[float, float, int]  # (mean 1-minute load average, highest CPU steal share, cores)


def machine_load(run: Run) -> Optional[Load]:
    """(mean 1-minute load average, highest CPU steal share, cores) over a run's levels; None: not recorded."""
    loads = [v for lv in run.levels if (v := lv.number("machine.load_avg_1m")) is not None]
    steals = [v for lv in run.levels if (v := lv.number("machine.steal_share")) is not None]
    cores = next((int(v) for lv in run.levels if (v := lv.number("machine.cores")) and v > 0), None)
    if not loads or cores is None:
        return None
    return sum(loads) / len(loads), max(steals, default=0.0), cores


def loads_differ(loads: list[Load]) -> bool:
    per_core = [load / cores for load, _, cores in loads]
    steal = [st for _, st, _ in loads]
    return max(steal) - min(steal) > STEAL_DIFF or max(per_core) - min(per_core) > LOAD_PER_CORE_DIFF


def load_words(v: Load) -> str:
    load, steal, cores = v
    return (f"load {load:.1f} on {cores} core{'s' if cores != 1 else ''}"
            + (f", CPU steal {steal * 100:.0f} %" if steal >= 0.005 else ""))


def load_difference(run_a: Run, run_b: Run) -> Optional[str]:
    """"load 1.9 on 2 cores vs load 4.1 on 2 cores, CPU steal 12 %" when the two runs' machine load
    differed; None when it did not or either run did not record it."""
    if run_a is run_b:
        return None
    a, b = machine_load(run_a), machine_load(run_b)
    if a is None or b is None or not loads_differ([a, b]):
        return None
    return f"{load_words(a)} vs {load_words(b)}"


def _server(run: Run) -> str:
    build = " ".join(str(p) for p in (run.backend_name, run.backend_version) if p)
    weights = run.weights_text
    return build if weights == "—" else f"{build} on {weights}"


def setup_difference(run_a: Run, run_b: Run) -> str:
    """" (llama.cpp 0.3.36 on GGUF Q4_1, 5.74 bits/weight vs vLLM 0.32.0 on bfloat16)" when two runs
    ran different engines or weights, so that a sentence comparing them says what it compares; ""
    when they ran the same."""
    a, b = _server(run_a), _server(run_b)
    return "" if a == b else f" ({a} vs {b})"
