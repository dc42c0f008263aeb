"""One verdict per scenario, written as a person would say it: the configuration to run, why, and the
caveat that limits it. Pure: an aggregate in, Verdicts out.

How a verdict is reached, in order:

1. The speed figure decides first: with a latency objective, the most concurrent users (or the highest
   request rate) within it (recommend.capacity); without one, peak throughput. Every configuration whose
   figure is not measurably below the best one's (noise.compare: the repeats' CIs, else a 5 % minimum
   effect and the levels' own dispersion) ties with it. A difference within noise is never a winner.
2. Among the tied, quality: a KV dtype whose measured mean KL divergence (deepest depth measured, from any
   run of the same backend, model and KV dtype) exceeds DRIFT_LIMIT drops out while one within it remains.
3. Then KV memory per token (the server's own KV bytes over its token capacity): less memory per token is
   more capacity in the same memory, which is why one picks a smaller KV dtype.
4. Then lower drift, then throughput. Configurations left equal on every count are named together.

Before any of this, comparable.partition decides which runs can be compared at all (same workload, weights,
CPU placement and machine load; complete; KV dtype confirmed; one copy of each document): the verdict picks
only within such a field, and every run left out is named under it with its one reason.

The caveat names what limits the verdict: one run each (and the noise threshold that implies), runs of
different weights, model files or engine builds, and machine load that differed between runs (a lead
measured under other load is not called one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Optional

from kvexp.analysis import comparable, conditions as C, documents as D, noise, recommend
from kvexp.analysis.qualityfindings import fmt_kld
from kvexp.metrics.levels import Level
from kvexp.metrics.registry import is_num
from kvexp.results.doc import Doc
from kvexp.results.runs import SLO, Aggregate, Run

# A mean KL divergence (nats per token, against the 16-bit cache) above which a KV dtype's drift is
# called visible: llama.cpp's q8_0 caches measure about 0.001-0.003, q4_0 0.02 and more.
DRIFT_LIMIT = 0.01


@dataclass(frozen=True)
class Candidate:
    run: Run
    name: str  # the short name: backend + KV dtype (+ model when models vary)
    figure: Optional[float]  # capacity within the SLO, or peak throughput
    level: Optional[Level]  # the level the figure was read at
    bytes_per_token: Optional[float]
    drift: Optional[tuple[float, int]]  # (mean KLD, depth)


@dataclass(slots=True, frozen=True)
class Verdict(Doc):
    """One scenario's verdict (an aggregate's `verdicts`)."""

    NESTED: ClassVar[Mapping[str, Callable[[Any], Any]]] = {"choice": tuple, "excluded": tuple}

    scenario: str = ""
    choice: tuple[str, ...] = ()  # short names of the configuration(s) to run; () when nothing can be said
    why: str = ""
    caveat: str = ""
    excluded: tuple[str, ...] = ()  # "llama.cpp q8_0 (label): not compared, because ...", one per run left out
    present: Optional[frozenset[str]] = field(default=None, repr=False, compare=False)

    @property
    def sentence(self) -> str:
        left = ("; ".join(self.excluded) + ".") if self.excluded else ""
        return " ".join(s for s in (self.why, self.caveat, left) if s)


def short_names(runs: list[Run]) -> dict[str, str]:
    """Label -> "llama.cpp q8_0" (+ the model where one backend served several: each backend serves its own
    file of a model, a GGUF or a checkpoint, which the verdict's caveat names; + the label where still
    ambiguous)."""
    models: dict[str, set[str]] = {}
    for r in runs:
        if r.state != "skipped":  # a skipped job names the model option, not the file it would serve
            models.setdefault(str(r.backend), set()).add(str(r.model))
    varies = any(len(m) > 1 for m in models.values())
    names = {}
    for r in runs:
        if r.tool:  # another benchmark tool's run: its label says which tool and run
            names[r.label] = r.label
            continue
        kv = r.kv.name or "default KV"
        name = f"{r.backend_name} {kv}"
        if varies:
            name += f", {r.model_file}"
        names[r.label] = name
    counts: dict[str, int] = {}
    for n in names.values():
        counts[n] = counts.get(n, 0) + 1
    return {lab: (n if counts[n] == 1 else f"{n} ({lab})") for lab, n in names.items()}


def drift(run: Run) -> Optional[tuple[float, int]]:
    """(mean KLD, depth) at the deepest depth the run's quality block measured."""
    d = run.quality.deepest if run.quality is not None else None
    return None if d is None else (float(d.kld_mean), int(d.context))  # type: ignore[arg-type]


def kv_key(run: Run) -> tuple[str, str, Optional[str]]:
    return str(run.backend), str(run.model), run.kv.name


def kv_lookups(aggregate: Aggregate) -> tuple[dict, dict]:
    """KV bytes per token and drift per (backend, model, KV dtype), from any run that measured them."""
    mem: dict[tuple, float] = {}
    kld: dict[tuple, tuple[float, int]] = {}
    for r in aggregate.runs:
        b, q = r.bytes_per_token, drift(r)
        if b is not None:
            mem.setdefault(kv_key(r), b)
        if q is not None:
            kld.setdefault(kv_key(r), q)
    return mem, kld


def _candidates(runs: list[Run], slo: Optional[SLO], names: dict, mem: dict, kld: dict) -> list[Candidate]:
    out = []
    for r in runs:
        if slo is not None:
            cap = recommend.capacity(r, slo)
            fig, lv = cap["capacity"], cap["level"]
        else:
            lv = recommend.peak_level(r)
            fig = lv.number("throughput_tok_s") if lv else None
        out.append(Candidate(r, names[r.label], fig, lv, mem.get(kv_key(r)), kld.get(kv_key(r))))
    return out


def _ties(best: Candidate, cands: list[Candidate], slo: Optional[SLO]) -> tuple[list[Candidate], list[Any]]:
    """Those not measurably below the best on the speed figure, and the noise verdicts that said so."""
    tied, verdicts = [best], []
    for c in cands:
        if c is best or c.figure is None:
            continue
        if slo is not None and c.figure < best.figure:  # type: ignore[operator]
            continue  # fewer users within the objective: a count, not a noisy estimate
        v = noise.compare(best.run, best.level, c.run, c.level) if best.level and c.level else None
        verdicts.append(v)
        if v is None or not v.measurable:  # a lead under other machine load is not called one (noise.compare)
            tied.append(c)
    return tied, verdicts


def _order(tied: list[Candidate]) -> tuple[list[Candidate], str]:
    """Tied candidates in the order quality, memory, drift, throughput decide; and what decided."""
    within = [c for c in tied if c.drift is None or c.drift[0] <= DRIFT_LIMIT]
    pool = within if within else tied
    dropped = [c for c in tied if c not in pool]

    def key(c: Candidate) -> tuple:
        return (c.bytes_per_token if c.bytes_per_token is not None else float("inf"),
                c.drift[0] if c.drift else float("inf"), -(_tput(c.level) or 0.0))

    pool = sorted(pool, key=key)
    if len(pool) > 1 and None not in (pool[0].bytes_per_token, pool[1].bytes_per_token) \
            and pool[1].bytes_per_token != pool[0].bytes_per_token:
        how = "memory"
    elif len(pool) > 1 and pool[0].drift and pool[1].drift and pool[0].drift[0] < pool[1].drift[0]:
        how = "drift"
    else:
        how = "quality" if dropped else "none"
    return pool + dropped, how


def _tput(level: Optional[Level]) -> Optional[float]:
    return level.number("throughput_tok_s") if level is not None else None


def _fmt_fig(c: Candidate, slo: Optional[SLO]) -> str:
    if slo is not None:
        kind = recommend.capacity(c.run, slo)["kind"]
        return f"{c.figure:g} {'concurrent requests' if kind == 'concurrency' else 'requests/s'}"
    return f"{c.figure:,.1f} tok/s"


def _where(c: Candidate) -> str:
    x = c.level.x if c.level is not None else None
    return f" at {D.x_words(x[0])} {x[1]:g}" if x else ""


def _memory_words(first: Candidate, others: list[Candidate]) -> str:
    worst = max((c for c in others if c.bytes_per_token), key=lambda c: c.bytes_per_token or 0, default=None)
    if first.bytes_per_token is None or worst is None or worst.bytes_per_token == first.bytes_per_token:
        return ""
    ratio = worst.bytes_per_token / first.bytes_per_token  # type: ignore[operator]
    return (f"its KV cache takes {first.bytes_per_token:,.0f} bytes per token{_window_words(first.run)} against "
            f"{worst.bytes_per_token:,.0f} for {worst.name}, {ratio:.2f}x the tokens in the same memory")


def _window_words(run: Run) -> str:
    """For a sliding-window model, what its bytes per token are made of: the global layers' bytes per
    token and one sequence's window, as its planner block sized them ("" for other models)."""
    p = run.planner
    per_token = p.kv_bytes_per_token if p is not None else None
    window = p.window_bytes_per_sequence if p is not None else None
    if not is_num(per_token) or window is None:
        return ""
    return (f" it holds (a sliding-window model: {per_token:,.0f} bytes per token in its global layers "
            f"+ {window / (1 << 20):,.2f} MiB of window a sequence)")


def _drift_words(c: Candidate) -> str:
    if not c.drift:
        return ""
    above = f", above the {DRIFT_LIMIT:g} at which drift is visible" if c.drift[0] > DRIFT_LIMIT else ""
    return f"mean KLD {fmt_kld(c.drift[0])} at depth {c.drift[1]}{above}"


# KV dtypes that are not quantised: choosing one costs no quality worth measuring.
SIXTEEN_BIT = {"fp16", "f16", "bf16", "fp32", "f32", "auto", "float16", "bfloat16", "float32"}
# Level warnings that make the figure a verdict rests on the client's or the delivery's, not the server's.
FLAG_WORDS = {"client_limited": "client-limited (the load generator, not the server, set the pace)",
              "bursts": "bursty (the server streamed in bursts: client TPOT reflects delivery)"}


def _unmeasured_words(c: Candidate) -> str:
    """For a quantised KV dtype chosen on memory whose drift no run measured: say so and how to measure it."""
    kv = c.run.kv.name
    if c.drift is not None or kv is None or kv.lower() in SIXTEEN_BIT or c.run.tool:
        return ""
    return (f" Its quality was not measured: {kv} KV is chosen on memory alone; measure its drift from the 16-bit "
            f"cache with `python -m kvexp -m backend={c.run.backend} kv=fp16,{kv} scenario=quality` "
            f"(a mean KLD above {DRIFT_LIMIT:g} is visible drift) before relying on it.")


def _flag_words(chosen: list[Candidate]) -> str:
    codes = []
    for c in chosen:
        found = c.level.warning_codes if c.level is not None else set()
        if c.level is not None and c.level.client_limited is True:
            found = found | {"client_limited"}
        codes += [k for k in FLAG_WORDS if k in found and k not in codes]
    if not codes:
        return ""
    return "the figure it rests on comes from a level flagged " + " and ".join(FLAG_WORDS[k] for k in codes)


def _caveat(runs: list[Run], verdicts: list[Any], names: dict[str, str],
            chosen: Optional[list[Candidate]] = None) -> str:
    parts = []
    flags = _flag_words(chosen or [])
    if flags:
        parts.append(flags)
    repeated = all(len(noise.repeat_values(r, lv, "throughput_tok_s")) >= 2
                   for r in runs for lv in r.merged_levels()[:1])
    thresholds = [v.threshold_pct for v in verdicts if v is not None and v.threshold_pct is not None]
    if not repeated:
        noise_part = (noise.DISPERSED if thresholds and max(thresholds) > noise.MAX_THRESHOLD_PCT
                      else f"differences under {max(thresholds):.0f} % are noise here" if thresholds
                      else "no difference can be told from noise")
        parts.append(f"one run each: {noise_part}" + ("" if noise_part == noise.DISPERSED
                                                      else "; repeat with scenario.repeats=3"))
    weights = sorted({r.weights_text for r in runs} - {"—"})
    models = sorted({r.model_file for r in runs})
    if len(weights) > 1:
        parts.append("the configurations ran different weights (" + " vs ".join(weights) + ")")
    elif len(models) > 1:
        parts.append("the configurations served different model files (" + ", ".join(models) + ")")
    builds = sorted({f"{r.backend_name} {r.backend_version}" for r in runs if r.backend_version})
    if len({str(r.backend) for r in runs}) > 1 and builds:
        parts.append("engine builds " + ", ".join(builds))
    unconfirmed = [names.get(r.label, r.label) for r in runs
                   if r.kv_requested and not r.kv_cache.dtype and not r.tool]
    if unconfirmed:
        parts.append("the server did not confirm the KV dtype of " + ", ".join(unconfirmed)
                     + " (what was asked, not what ran)")
    loads = {names.get(r.label, r.label): C.machine_load(r) for r in runs}
    known = {k: v for k, v in loads.items() if v is not None}
    if len(known) > 1 and C.loads_differ(list(known.values())):
        parts.append("the machine's load differed between runs (" + "; ".join(
            f"{k}: {C.load_words(v)}" for k, v in known.items()) + "), so a lead may be the machine's")
    return ("Caveat: " + "; ".join(parts) + ".") if parts else ""


def _speed_verdict(scenario: str, runs: list[Run], slo: Optional[SLO], names: dict, mem: dict,
                   kld: dict) -> Optional[Verdict]:
    cands = [c for c in _candidates(runs, slo, names, mem, kld) if c.figure is not None]
    if not cands:
        return None
    best = max(cands, key=lambda c: (c.figure, _tput(c.level) or 0.0))
    tied, verdicts = _ties(best, cands, slo)
    ordered, how = _order(tied)
    first = ordered[0]
    basis = f"within {recommend.slo_text(slo)}" if slo else "peak throughput (no latency objective set)"
    if len(cands) == 1:
        why = f"{scenario}: {first.name} is the only configuration measured: {_fmt_fig(first, slo)}{_where(first)}."
        return Verdict(scenario, (first.name,), why, "Caveat: nothing to compare it with; sweep KV dtypes or "
                                                     "backends (-m kv=fp16,q8_0) for a choice.")
    if len(tied) == 1:
        runner = max((c for c in cands if c is not first), key=lambda c: c.figure)  # type: ignore[arg-type]
        why = (f"{scenario}: run {first.name}{_where(first)}. By {basis} it leads, {_fmt_fig(first, slo)} against "
               f"{_fmt_fig(runner, slo)} for {runner.name}, a measurable difference.")
        extra = [w for w in (_memory_words(first, [runner]), _drift_words(first) and f"its KV drift is "
                             f"{_drift_words(first)}") if w]
        if extra:
            text = "; ".join(extra)
            why += f" {text[0].upper()}{text[1:]}."
        return Verdict(scenario, (first.name,), why, _caveat(runs, verdicts, names, [first]))
    figures = ", ".join(f"{c.name} {_fmt_fig(c, slo)}" for c in ordered)
    dispersed = any(v is not None and v.dispersed for v in verdicts)
    tie = (f"{scenario}: by {basis}, {len(tied)} configurations cannot be told apart ({figures}: "
           f"{noise.DISPERSED})" if dispersed else
           f"{scenario}: by {basis}, {len(tied)} configurations tie ({figures}: no measurable difference)")
    if how == "memory":
        why = f"{tie}, so KV memory decides: run {first.name}{_where(first)}; {_memory_words(first, ordered[1:])}"
        if first.drift:
            why += f", with {_drift_words(first)}"
        why += "." + _unmeasured_words(first)
        choice: tuple[str, ...] = (first.name,)
    elif how == "drift":
        why = (f"{tie}, so quality decides: run {first.name}{_where(first)}, {_drift_words(first)} against "
               f"{_drift_words(ordered[1])} for {ordered[1].name}.")
        choice = (first.name,)
    elif how == "quality":
        dropped = [c for c in ordered if c.drift and c.drift[0] > DRIFT_LIMIT]
        why = (f"{tie}; {', '.join(c.name for c in dropped)} drift beyond a mean KLD of {DRIFT_LIMIT:g}, "
               f"so run {first.name}{_where(first)}.")
        choice = (first.name,)
    else:
        why = f"{tie}, and nothing measured tells them apart: either will do."
        choice = tuple(c.name for c in ordered)
    return Verdict(scenario, choice, why, _caveat(runs, verdicts, names, [c for c in ordered if c.name in choice]))


def _quality_verdict(scenario: str, runs: list[Run], names: dict, mem: dict) -> Optional[Verdict]:
    """A scenario with quality blocks and no speed levels: the smallest KV within DRIFT_LIMIT."""
    cands = [Candidate(r, names[r.label], None, None, mem.get(kv_key(r)), drift(r)) for r in runs]
    cands = [c for c in cands if c.drift is not None]
    if not cands:
        return None
    ordered, _ = _order(cands)
    first = ordered[0]
    parts = [f"{c.name}: {_drift_words(c)}" + (f", {c.bytes_per_token:,.0f} bytes per token"
                                                if c.bytes_per_token else "") for c in ordered]
    if first.drift[0] > DRIFT_LIMIT:  # type: ignore[index]
        why = (f"{scenario}: every KV dtype measured drifts beyond a mean KLD of {DRIFT_LIMIT:g} "
               f"({'; '.join(parts)}); keep the 16-bit cache.")
        return Verdict(scenario, (), why, "")
    why = (f"{scenario}: run {first.name}: the least KV memory per token among the dtypes whose drift stays within "
           f"a mean KLD of {DRIFT_LIMIT:g} ({'; '.join(parts)}).")
    return Verdict(scenario, (first.name,), why, "")


def _left_words(left: list[comparable.Left], names: dict[str, str]) -> tuple[str, ...]:
    out = []
    for x in left:
        name = names.get(x.label, x.label)
        who = name if x.label in name else f"{name} ({x.label})"
        out.append(f"{who}: not compared, because {x.reason}")
    return tuple(out)


def _cross_words(f: comparable.Field) -> str:
    return ("Engines and weights differ together here (" + "; ".join(f.engines) + "): a difference below is the "
            "engine's and its weights' together, not the KV dtype's alone. ")


def _missed(scenario: str, runs: list[Run], slo: SLO, names: dict) -> Optional[Verdict]:
    """Every run of a field misses the objectives at its lowest level: say so, and by how much the closest does."""
    caps = [(r, recommend.capacity(r, slo)) for r in runs]
    if any(c["capacity"] is not None for _, c in caps) or not any(c["miss_pct"] is not None for _, c in caps):
        return None
    r, c = min(((r, c) for r, c in caps if c["miss_pct"] is not None), key=lambda rc: rc[1]["miss_pct"])
    why = (f"{scenario}, {recommend.slo_text(slo)}: {recommend.SLO_MISSED}: no configuration meets the objectives; "
           f"the closest, {names.get(r.label, r.label)}, misses by {c['miss_pct']:g} % at its "
           f"lowest level ({D.x_words(c['kind'])} {c['miss_at']:g}: {c['miss_what']}). Relax the objectives or "
           "measure lower levels.")
    return Verdict(scenario, (), why, "")


def _field_verdict(scen: str, f: comparable.Field, slo: Optional[SLO], names: dict, mem: dict,
                   kld: dict) -> Optional[Verdict]:
    rs = list(f.runs)
    v = _missed(scen, rs, slo, names) if slo is not None else None
    v = v or _speed_verdict(scen, rs, slo, names, mem, kld) or _quality_verdict(scen, rs, names, mem)
    if v is not None and f.cross_engine:
        v = Verdict(v.scenario, v.choice, _cross_words(f) + v.why, v.caveat)
    return v


def verdicts(aggregate: Aggregate) -> list[Verdict]:
    """One verdict per scenario (and per latency objective where a scenario's runs set different ones), and
    per field of comparable runs within it (comparable.partition): the runs left out are named under it,
    each with its reason."""
    mem, kld = kv_lookups(aggregate)
    out: list[Verdict] = []
    for scen, runs in aggregate.scenarios():
        names = short_names([r for r in runs if r.state != "skipped"])
        names.update({r.label: r.kind.replace(", ", " ").replace(" KV", "") for r in runs if r.label not in names})
        groups: dict[Optional[SLO], list[Run]] = {}
        for r in runs:
            groups.setdefault(r.objectives, []).append(r)
        for slo, rs in groups.items():
            fields, left = comparable.partition(rs)
            made = [v for f in fields for v in [_field_verdict(scen, f, slo, names, mem, kld)] if v is not None]
            excluded = _left_words(left, names)
            if not made and not any(r.state != "skipped" for r in rs):
                continue  # only skipped jobs: nothing was measured, and the skip is reported as such
            if not made:
                why = (f"{scen}: no two runs can be compared, so no configuration is chosen" if len(rs) > 1
                       else f"{scen}: nothing usable was measured, so no configuration is chosen") + "."
                made = [Verdict(scen, (), why, "")]
            lone = [f for f in fields if len(f.runs) == 1]
            if len(fields) == 1 and lone and any("identical copy" not in x.reason for x in left):
                name = names.get(lone[0].runs[0].label, "")
                made[0] = Verdict(scen, (), f"{scen}: no configuration is chosen: {name} is the only run that "
                                           "can be compared, and nothing measured here is comparable with it.", "")
            made[0] = Verdict(made[0].scenario, made[0].choice, made[0].why, made[0].caveat, excluded)
            out += made
    return out
