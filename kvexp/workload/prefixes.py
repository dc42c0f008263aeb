"""Shared prefixes: which of a scenario's `prefix_groups` prefixes each request starts with, and the
token ids of a group's prefix. Seeded and pure."""

from __future__ import annotations

import random


def prefix_groups_of(n: int, groups: int, seed: int) -> list[int]:
    """The prefix group (0..groups-1) of each of n requests: every group n//groups or n//groups+1
    of them, in a seeded shuffled order."""
    if groups < 1:
        raise ValueError(f"groups={groups}: must be >= 1")
    order = [i % groups for i in range(n)]
    random.Random(f"prefix-groups:{seed}").shuffle(order)
    return order


def prefix_tokens_of(pool: list[int], group: int, length: int, seed: int) -> list[int]:
    """The shared prefix of a group: `length` token ids from `pool`, the same for every request of it."""
    if not pool and length > 0:
        raise ValueError("the token pool is empty")
    return random.Random(f"prefix:{seed}:{group}").choices(pool, k=length)
