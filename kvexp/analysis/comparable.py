"""Which runs can be compared at all, decided before any ranking (verdict.py picks only within a field).

Two runs are compared only when a difference between their figures can be credited to their
configurations: the same scenario and workload (prompt and output tokens), the same model file and
weights, the same CPU placement of the server, like machine load, each complete, each with the KV dtype
its server confirmed, and each a distinct measurement. A run that fails one of these is left out of the
comparison with one reason, in this order:

1. skipped, failed or partial (an interrupted run never wins);
2. an identical copy of a run already counted (the same document read twice is one run);
3. its server did not confirm the KV dtype asked for (what ran is not known);
4. another workload, other weights or model file, another CPU placement than the field it would join;
5. measured under other machine load than the field (conditions.loads_differ): not comparable, never a tie.

Runs of different engines whose weights differ only because each engine serves its own file of the
model (llama.cpp a GGUF, vLLM a checkpoint: each backend one file, each file one backend) are one field
marked `cross_engine`: the user asked for that comparison, and the verdict's first sentence says that
engines and weights differ together. Pure: aggregate runs in, Fields and Left-outs out."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from kvexp.analysis import conditions as C, documents as D
from kvexp.results.runs import Run


@dataclass(frozen=True)
class Left:
    """A run left out of a comparison: its label and why, as "not compared, because <reason>" reads."""

    label: str
    reason: str


@dataclass(frozen=True)
class Field:
    """Runs that can be compared with each other; cross_engine: engines and their weights differ together."""

    runs: tuple[Run, ...]
    cross_engine: bool = False
    engines: tuple[str, ...] = field(default=())  # cross_engine: "llama.cpp 0.3 on GGUF Q4_1 (file)" per engine


def weights_words(run: Run) -> str:
    w = run.weights_text
    return run.model_file if w == "—" else f"{w}, {run.model_file}"


def placement_key(run: Run) -> Optional[tuple[str, tuple[int, ...]]]:
    """(mode, the CPUs the server had) from environment.placement (Placement.key): the CPUs every thread of
    its process tree was read back on, else those it was pinned to (None: not recorded, e.g. another tool's
    run). Two runs placed alike have the same key; a server whose processes ran outside the CPUs it was
    given has the CPUs it ran on, so it is not compared with one that kept to them."""
    return run.placement.key if run.placement is not None else None


def _cpu_words(cpus: tuple[int, ...]) -> str:
    return f"CPU{'s' if len(cpus) != 1 else ''} {','.join(map(str, cpus))}"


def placement_words(key: Optional[tuple[str, tuple[int, ...]]]) -> str:
    if key is None:
        return "placement not recorded"
    mode, cpus = key
    if mode == "split" and cpus:
        return f"the server's processes on {_cpu_words(cpus)}"
    return "the server sharing every CPU with the client" + (f" ({_cpu_words(cpus)})" if cpus else "")


def _fingerprint(run: Run) -> str:
    return json.dumps({k: v for k, v in run.to_json().items() if k not in ("label", "source")}, sort_keys=True,
                      default=str)


def _sketch(run: Run) -> str:
    """A few of _fingerprint's fields, in its words: runs whose fingerprints agree agree in this."""
    return json.dumps([run.started_at, run.backend, run.model, run.scenario, run.kv_requested, len(run.levels)],
                      default=str)


def _status_reason(run: Run) -> Optional[str]:
    status = run.state
    why = D.first_line(run.status_reason, 160)
    if status == "skipped":
        return "it was skipped, not run" + (f" ({why})" if why else "")
    if status == "failed":
        return "it failed" + (f" ({why})" if why else "")
    if status == "partial":
        return "it did not finish (status partial" + (f": {why}" if why else "") + "); a partial run never wins"
    return None


def _cross_engine(runs: list[Run]) -> bool:
    """Each backend served one weights file and each file one backend, and there are several backends."""
    by_backend: dict[str, set[str]] = {}
    by_weights: dict[str, set[str]] = {}
    for r in runs:
        by_backend.setdefault(str(r.backend), set()).add(weights_words(r))
        by_weights.setdefault(weights_words(r), set()).add(str(r.backend))
    return len(by_backend) > 1 and len(by_weights) > 1 and all(len(v) == 1 for v in by_backend.values()) \
        and all(len(v) == 1 for v in by_weights.values())


def _engine(run: Run) -> str:
    build = " ".join(str(p) for p in (run.backend_name, run.backend_version) if p)
    return f"{build} on {weights_words(run)}"


def _differs(run: Run, ref: Run, cross: bool) -> str:
    """Why `run` is not comparable with `ref` (the field's first run), in words."""
    if (run.prompt_tokens, run.max_tokens) != (ref.prompt_tokens, ref.max_tokens):
        return (f"another workload ({run.prompt_tokens} prompt / {run.max_tokens} output tokens "
                f"against {ref.prompt_tokens} / {ref.max_tokens})")
    if weights_words(run) != weights_words(ref) and not cross:
        return f"other weights ({weights_words(run)} against {weights_words(ref)})"
    return (f"another CPU placement ({placement_words(placement_key(run))} against "
            f"{placement_words(placement_key(ref))})")


def _load_clusters(runs: list[Run]) -> tuple[list[Run], list[tuple[Run, str]]]:
    """The largest set of runs measured under like machine load (runs that recorded none join it), and the
    others with their load against the set's."""
    known = [(r, C.machine_load(r)) for r in runs]
    loaded = [(r, v) for r, v in known if v is not None]
    if len(loaded) < 2 or not C.loads_differ([v for _, v in loaded]):
        return runs, []
    loaded.sort(key=lambda rv: rv[1][0] / rv[1][2])
    best: list[tuple[Run, Any]] = []
    for i in range(len(loaded)):
        group = [loaded[i]]
        # the group's extremes, kept as it grows (C.loads_differ over the group and one more, in O(1)); past
        # the first run too loaded for it, every later one is too (sorted by load per core)
        lo_core = hi_core = loaded[i][1][0] / loaded[i][1][2]
        lo_steal = hi_steal = loaded[i][1][1]
        for rv in loaded[i + 1:]:
            core, steal = rv[1][0] / rv[1][2], rv[1][1]
            if core - lo_core > C.LOAD_PER_CORE_DIFF:
                break
            if not C.loads_differ([(lo_core, lo_steal, 1), (hi_core, hi_steal, 1), (core, steal, 1)]):
                group.append(rv)
                lo_core, hi_core = min(lo_core, core), max(hi_core, core)
                lo_steal, hi_steal = min(lo_steal, steal), max(hi_steal, steal)
        if len(group) > len(best):
            best = group
    kept_ids = {id(r) for r, _ in best}
    ref = C.load_words(best[0][1]) if len(best) > 1 else None
    out = []
    for r, v in loaded:
        if id(r) not in kept_ids or len(best) < 2:
            against = f"{ref} for the compared runs" if ref else "; ".join(
                f"{C.load_words(w)} for {o.label}" for o, w in loaded if o is not r)
            out.append((r, f"the machine's load differed ({C.load_words(v)} here, {against}): not comparable"))
    if len(best) < 2:
        return [], out
    return [r for r in runs if id(r) in kept_ids or C.machine_load(r) is None], out


def partition(runs: list[Run]) -> tuple[list[Field], list[Left]]:
    """A scenario's runs (one latency objective) as the fields that can be compared and the runs left out.
    A field holds two or more runs; a lone run that nothing excludes is a field of one."""
    left: list[Left] = []
    seen: dict[str, str] = {}
    alike: dict[str, list[Run]] = {}  # runs by a few of their fields: only runs alike in these can be copies
    fps: dict[int, str] = {}  # each run's whole-document fingerprint, made only where a copy is possible
    named: set[int] = set()  # the runs whose fingerprint is in seen

    def fp_of(x: Run) -> str:
        return fps[id(x)] if id(x) in fps else fps.setdefault(id(x), _fingerprint(x))

    live: list[Run] = []
    for r in runs:
        label = r.label
        why = _status_reason(r)
        if why is None:
            earlier = alike.setdefault(_sketch(r), [])
            for o in earlier:  # the first of each fingerprint names it
                if id(o) not in named:
                    named.add(id(o))
                    seen.setdefault(fp_of(o), o.label)
            copy_of = seen.get(fp_of(r)) if earlier else None
            earlier.append(r)
            if copy_of is not None:
                why = f"it is an identical copy of {copy_of}: one run, counted once"
            else:
                if not r.kv_confirmed:
                    why = (f"its server did not confirm the KV dtype asked for ({r.kv_requested}): "
                           "what ran is not known")
        if why is None:
            live.append(r)
        else:
            left.append(Left(label, why))
    cross = _cross_engine(live)
    groups: dict[tuple, list[Run]] = {}
    for r in live:
        key = (r.prompt_tokens, r.max_tokens, "cross" if cross else weights_words(r), placement_key(r))
        groups.setdefault(key, []).append(r)
    ordered = sorted(groups.values(), key=len, reverse=True)
    fields: list[Field] = []
    lone: list[Run] = []
    for g in ordered:
        kept, loaded = _load_clusters(g)
        left += [Left(r.label, why) for r, why in loaded]
        if len(kept) >= 2 or (len(kept) == 1 and len(live) == 1):
            engines = tuple(sorted({_engine(r) for r in kept})) if cross else ()
            fields.append(Field(tuple(kept), cross and len({r.backend for r in kept}) > 1, engines))
        else:
            lone += kept
    for r in lone:
        ref = fields[0].runs[0] if fields else next((o for o in live if o is not r and any(o is x for x in lone)),
                                                    None)
        why = _differs(r, ref, cross) if ref is not None else "nothing like it was measured"
        left.append(Left(r.label, why))
    order = {r.label: i for i, r in enumerate(runs)}
    left.sort(key=lambda x: order.get(x.label, 0))
    return fields, left
