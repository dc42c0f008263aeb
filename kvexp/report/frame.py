"""Levels as a table for notebooks and scripts: one row per level of any mix of result files (kvexp's
own, the reference document, other tools' files), with the column names of comparison.csv.

    import kvexp
    df = kvexp.results_frame(["outputs/sweeps/2025-01-01_12-00-00", "vllm-results/"])

pandas is an optional extra (`pip install 'kvexp[frame]'`); `python -m kvexp results` writes the same
table as CSV without it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable, Union

from kvexp.analysis.aggregate import collect
from kvexp.report.tables import level_table

PathLike = Union[str, Path]


class FrameUnavailable(ImportError):
    """pandas is not installed; the message says how to install it."""


def _paths(paths: Union[PathLike, Iterable[PathLike]]) -> list[Path]:
    return [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]


def results_table(paths: Union[PathLike, Iterable[PathLike]]) -> tuple[list[str], list[list[Any]]]:
    """(column names, rows) of every level found in `paths`; raises kvexp.results.store.ResultError with one
    line for a file kvexp cannot read."""
    return level_table(collect(_paths(paths)))


def results_frame(paths: Union[PathLike, Iterable[PathLike]]) -> Any:
    """A pandas DataFrame, one row per level, the columns of comparison.csv (missing values are NaN, never
    0 or None)."""
    try:
        import pandas as pd  # lazy: an optional extra (kvexp[frame]); without it, say how to install it
    except ImportError:
        raise FrameUnavailable("results_frame needs pandas: pip install 'kvexp[frame]' (or pandas)") from None
    head, rows = results_table(paths)
    return pd.DataFrame([[math.nan if v is None else v for v in row] for row in rows], columns=head)
