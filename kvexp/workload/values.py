"""Checks the workload's modules share: a setting refused in one line (ConfigError), and what counts
as an integer or a finite number in a config or a file (never a bool)."""

from __future__ import annotations

import math
from typing import Any

from kvexp.core.config import ConfigError


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
