"""Length distributions of prompts and outputs around a scenario's own figure (the centre): check_dist,
sample_lengths, bounds, expected_mean, and dist_json (what a result records). Seeded and pure."""

from __future__ import annotations

import math
import random
from statistics import fmean
from typing import Any

from kvexp.core.config import MAX_TOKENS, ConfigError, DistKind, LengthDist
from kvexp.workload.values import is_int, is_num, require

EXPECTED_MEAN_SAMPLES = 20000  # samples behind the mean of a clipped normal or lognormal

# the fields each kind reads (a field given to a kind that does not read it is refused, not ignored)
DIST_FIELDS = {DistKind.fixed: (), DistKind.uniform: ("min", "max"), DistKind.normal: ("min", "max", "std"),
               DistKind.lognormal: ("min", "max", "sigma"), DistKind.histogram: ("bins", "weights")}


def _kind(d: LengthDist, key: str) -> DistKind:
    try:
        return DistKind(d.kind)
    except ValueError:
        raise ConfigError(f"{key}.kind={d.kind!r}: allowed values are {', '.join(k.value for k in DistKind)}") from None


def check_dist(d: LengthDist, centre: int, key: str) -> None:
    """Refuse a distribution that cannot be sampled, with one line starting with `key`."""
    kind = _kind(d, key)
    for name in ("min", "max", "std", "sigma", "bins", "weights"):
        given = getattr(d, name) not in (None, [])
        require(not given or name in DIST_FIELDS[kind],
                f"{key}.{name}: kind={kind} does not use it (it reads {', '.join(DIST_FIELDS[kind]) or 'nothing'})")
    if kind == DistKind.fixed:
        return
    if kind == DistKind.histogram:
        bins, weights = list(d.bins), list(d.weights)
        require(bool(bins), f"{key}: kind=histogram needs bins (the lengths) and weights")
        require(len(bins) == len(weights),
                f"{key}: kind=histogram needs as many weights as bins, got {len(bins)} bins and {len(weights)} weights")
        require(all(is_int(b) and 1 <= b <= MAX_TOKENS for b in bins),
                f"{key}.bins={bins}: every bin must be an integer in 1..{MAX_TOKENS:,}")
        require(all(is_num(w) and w >= 0 for w in weights) and sum(weights) > 0,
                f"{key}.weights={weights}: every weight must be >= 0 and their sum > 0")
        return
    require(d.min is not None and d.max is not None, f"{key}: kind={kind} needs min and max")
    for name in ("min", "max"):
        v = getattr(d, name)
        require(is_int(v) and 1 <= v <= MAX_TOKENS, f"{key}.{name}={v!r}: must be an integer in 1..{MAX_TOKENS:,}")
    if kind == DistKind.uniform:
        require(d.min <= d.max, f"{key}: kind=uniform needs 1 <= min <= max, got min={d.min}, max={d.max}")
        return
    spread = "std" if kind == DistKind.normal else "sigma"
    v = getattr(d, spread)
    require(is_num(v) and v > 0, f"{key}: kind={kind} needs {spread} > 0, got {spread}={v}")
    require(d.min <= centre <= d.max,
            f"{key}: kind={kind} needs 1 <= min <= centre <= max, got min={d.min}, centre={centre}, max={d.max}")


def sample_lengths(d: LengthDist, centre: int, n: int, seed: int) -> list[int]:
    """n lengths drawn from `d` around `centre` with random.Random(seed); the same seed, the same list."""
    check_dist(d, centre, "length distribution")
    kind, rng = DistKind(d.kind), random.Random(seed)
    if kind == DistKind.fixed:
        return [centre] * n
    if kind == DistKind.uniform:
        return [rng.randint(d.min, d.max) for _ in range(n)]
    if kind == DistKind.histogram:
        return rng.choices(list(d.bins), weights=list(d.weights), k=n)
    lo, hi = d.min, d.max
    if kind == DistKind.normal:
        return [min(hi, max(lo, round(rng.gauss(centre, d.std)))) for _ in range(n)]
    # lognormal: the exponent is capped (exp(50) x centre is far above any max) so it cannot overflow
    return [min(hi, max(lo, round(centre * math.exp(min(50.0, rng.gauss(0.0, d.sigma)))))) for _ in range(n)]


def bounds(d: LengthDist, centre: int) -> tuple[int, int]:
    """Smallest and largest length `d` can give (a histogram's bins of weight 0 are never drawn)."""
    check_dist(d, centre, "length distribution")
    kind = DistKind(d.kind)
    if kind == DistKind.fixed:
        return centre, centre
    if kind == DistKind.histogram:
        drawn = [b for b, w in zip(d.bins, d.weights) if w > 0]
        return min(drawn), max(drawn)
    return d.min, d.max


def expected_mean(d: LengthDist, centre: int) -> float:
    """Mean length of `d`: exact for fixed, uniform and histogram; for normal and lognormal (clipped)
    the mean of EXPECTED_MEAN_SAMPLES samples with seed 0."""
    check_dist(d, centre, "length distribution")
    kind = DistKind(d.kind)
    if kind == DistKind.fixed:
        return float(centre)
    if kind == DistKind.uniform:
        return (d.min + d.max) / 2
    if kind == DistKind.histogram:
        return sum(b * w for b, w in zip(d.bins, d.weights)) / sum(d.weights)
    return fmean(sample_lengths(d, centre, EXPECTED_MEAN_SAMPLES, seed=0))


def dist_json(d: LengthDist, centre: int) -> dict[str, Any]:
    """A length distribution as the result records it (with its mean)."""
    out: dict[str, Any] = {"kind": str(d.kind), "centre": centre}
    for key in DIST_FIELDS[DistKind(d.kind)]:
        value = getattr(d, key)
        out[key] = list(value) if isinstance(value, list) else value
    out["mean"] = round(expected_mean(d, centre), 3)
    return out
