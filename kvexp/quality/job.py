"""One job's quality measurement as its methods see it: the job's context (QualityJob), and the
shapes of what they fill in (one depth's teacher-forced entry, a teacher-forced block that could not
be measured)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvexp.core.config import ExperimentConfig, KVConfig, QualityConfig


@dataclass
class QualityJob:
    cfg: ExperimentConfig
    q: QualityConfig
    backend: Any  # the job's adapter, base_url set to its running server
    dtype: str  # the job's KV dtype, backend spelling
    base_kv: KVConfig
    base_dtype: str
    is_baseline: bool
    cache: Path
    text: str
    text_path: Path
    out_dir: Path
    label: str
    measured: list[str] = dataclasses.field(default_factory=list)  # what this job measured of the baseline
    warnings: list[str] = dataclasses.field(default_factory=list)


def teacher_forced_null(reason: str) -> dict[str, Any]:
    return {"method": None, "precision": None, "top_k": None, "depths": [], "reason": reason}


def depth_entry(depth: int, **kw: Any) -> dict[str, Any]:
    entry = {"context": depth, "status": "ok", "reason": None, "chunks": None, "positions": None,
             "kld_mean": None, "kld_mean_err": None, "kld_median": None, "kld_p99": None, "kld_max": None,
             "top1_agreement": None, "ppl_base": None, "ppl": None, "delta_ppl": None,
             "inexact_positions": None, "self_kld_mean": None, "self_top1_agreement": None,
             "rerun_identical": None, "ppl_base_f32": None}
    entry.update(kw)
    return entry
