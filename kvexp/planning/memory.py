"""The planner's memory prediction for a run beside what was measured: on a GPU the peak GPU memory,
on the CPU the peak resident set (RSS) of the server's processes (kvexp/capacity/cpumemory.py), each
level's prediction against that level's peak. Pure: a planner block and measured levels in, a
MemoryCheck out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from kvexp.metrics.levels import Level
from kvexp.results.blocks import Plan
from kvexp.results.documents import JobResult

MIB = 1 << 20


@dataclass(frozen=True)
class LevelMemory:
    x: Optional[float]  # the level's concurrency
    predicted_gib: Optional[float]
    measured_gib: Optional[float]

    @property
    def error_pct(self) -> Optional[float]:
        """(measured - predicted) / predicted, in percent (None: either unknown)."""
        if self.predicted_gib is None or self.measured_gib is None or not self.predicted_gib:
            return None
        return (self.measured_gib - self.predicted_gib) / self.predicted_gib * 100


@dataclass(frozen=True)
class MemoryCheck:
    """measure: "rss" (the server's processes on the CPU) or "vram" (GPU memory); peak: the predicted
    and measured peaks over the levels; parts: the prediction's parts in bytes (CPU: runtime, weights,
    buffers, KV cache, prompt cache)."""

    measure: str
    predicted_gib: Optional[float]
    measured_gib: Optional[float]
    levels: tuple[LevelMemory, ...]
    parts: tuple[tuple[str, Optional[float]], ...] = ()
    saved_prompts: Optional[int] = None
    gpu_planned: bool = False  # a CPU run planned as on a GPU (a document of an earlier kvexp): its figure is off

    @property
    def error_pct(self) -> Optional[float]:
        return LevelMemory(None, self.predicted_gib, self.measured_gib).error_pct

    @property
    def words(self) -> str:
        if self.measure != "rss":
            return "GPU memory"
        return "RSS of the server's processes (CPU)" + ("; planned as on a GPU (an earlier kvexp)"
                                                         if self.gpu_planned else "")


def _num(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def job_memory_check(job: JobResult) -> Optional[MemoryCheck]:
    """memory_check of a job's result."""
    return memory_check(job.planner, job.levels, bool(job.gpu.memory_gib or job.gpu.name))


def memory_check(plan: Optional[Plan], measured_levels: Sequence[Level], on_gpu: bool) -> Optional[MemoryCheck]:
    """The prediction in a run's planner block against its levels' measured peaks (None: no prediction).
    on_gpu: the run names a GPU (else its memory is the RSS of the server's processes)."""
    if plan is None or _num(plan.predicted_peak_memory_gib) is None:
        return None
    gpu_planned = plan.memory_measure is None and not on_gpu  # before the planner knew the CPU
    rss = plan.memory_measure == "rss" or gpu_planned
    rows = {_num(r.concurrency): r for r in plan.levels}
    levels = []
    for lv in measured_levels:
        if lv.failed:
            continue
        x = lv.number("concurrency")
        measured = lv.number("peak_rss_gib") if rss else (lv.number("peak_server_gpu_gib")
                                                          or lv.number("peak_vram_gib"))
        row = rows.get(x)
        predicted = (_num(row.predicted_rss_gib if row else None) if rss and not gpu_planned
                     else _num(plan.predicted_peak_memory_gib))
        levels.append(LevelMemory(x, predicted, measured))
    measured = [lv.measured_gib for lv in levels if lv.measured_gib is not None]
    cpu = plan.cpu_memory if rss else None
    parts: tuple[tuple[str, Optional[float]], ...] = ()
    if cpu is not None:
        parts = tuple((name, _num(getattr(cpu, key))) for name, key in (
            ("runtime", "runtime_bytes"), ("weights", "weights_bytes"), ("buffers", "buffers_bytes"),
            ("KV cache", "kv_cache_bytes"), ("prompt cache", "prompt_cache_bytes")))
    return MemoryCheck("rss" if rss else "vram", _num(plan.predicted_peak_memory_gib),
                       max(measured) if measured else None, tuple(levels), parts,
                       cpu.saved_prompts if cpu is not None else None, gpu_planned)


def parts_words(check: MemoryCheck) -> str:
    """"runtime 39 + weights 94 + buffers 15 + KV cache 22 + prompt cache 160 MiB (38 prompts)"."""
    shown = [f"{name} {value / MIB:,.0f}" for name, value in check.parts if value is not None]
    if not shown:
        return "—"
    tail = f" ({check.saved_prompts} prompts)" if check.saved_prompts else ""
    return " + ".join(shown) + " MiB" + tail
