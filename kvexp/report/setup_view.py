"""The report's setup section: the machine, the backends and their versions, every run (and which tool
measured it), the KV cache as each server reported it, the scenarios, the environment and the launch
commands; and the report's default title."""

from __future__ import annotations

import re
import shlex
from typing import Any, Optional

from kvexp.analysis import documents as D
from kvexp.metrics.registry import format_value, is_num
from kvexp.report.tables import Table, drop_empty, tool_name, uniq
from kvexp.results.runs import Aggregate, Run


def _short_model(model: Any) -> str:
    s = str(model or "—")
    return s.rsplit("/", 1)[-1] if s.startswith(("/", ".")) else s


def _gib(v: Any) -> Optional[float]:
    return v / 2**30 if is_num(v) else None


def device_text(aggregate: Aggregate) -> Optional[str]:
    """The GPU(s) of the runs; "CPU only: <model>" when no run had a GPU and the environment names the
    CPU; None when neither is known."""
    gpus = uniq([aggregate.gpu, *(r.gpu for r in aggregate.runs)])
    if gpus:
        return ", ".join(map(str, gpus))
    cpu = aggregate.environment.cpu if aggregate.environment is not None else None
    return f"CPU only: {cpu}" if cpu else None


def _plain(v: object) -> str:
    """A value as a person reads it: a mapping as "key value, ...", a list joined by spaces (a command line),
    unknown as "—"."""
    if isinstance(v, dict):
        return ", ".join(f"{k} {_plain(x)}" for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return " ".join(_plain(x) for x in v)
    if isinstance(v, bool):
        return "yes" if v else "no"
    return "—" if v is None else str(v)


# A checkpoint kvexp dequantised from a GGUF for vLLM is named after it: <GGUF stem>-<dtype>-<sha256 prefix>.
_DEQUANTISED = re.compile(r"^(?P<stem>.+)-(bf16|fp16|f16|float16|bfloat16)-[0-9a-f]{12}$")


def _model_stem(model: Any) -> str:
    name = _short_model(model)
    m = _DEQUANTISED.match(name)
    return m.group("stem") if m else name.removesuffix(".gguf")


def default_title(aggregate: Aggregate) -> str:
    """"kvexp comparison — <device> — <model> (llama.cpp: GGUF Q4_1; vLLM: bfloat16)": each model named once,
    with each backend's weights beside it where backends served it from different files."""
    gpu = device_text(aggregate) or "unknown GPU"
    runs = [r for r in aggregate.runs if r.state != "skipped"]
    models = uniq(_model_stem(r.model) for r in runs)
    if len(models) == 1:
        served = uniq(f"{r.backend_name}: {r.weights_text}" for r in runs)
        files = uniq(_short_model(r.model) for r in runs)
        what = models[0] + (f" ({'; '.join(served)})" if len(files) > 1 else "")
    else:
        what = ", ".join(models) if 0 < len(models) <= 3 else f"{len(models)} models" if models else "no runs"
    return f"kvexp comparison — {gpu} — {what}"


def _output_length(run: Run) -> str:
    flag = run.variable_length
    if flag is True:
        return "capped"
    if flag is False:
        return "forced"
    return "capped (assumed)" if run.caps_output_only else "—"


def setup_view(agg: Aggregate) -> dict:
    """The setup section's facts and tables, as strings."""
    runs = agg.runs
    facts: list[tuple[str, str]] = []
    gib = agg.gpu_gib
    facts.append(("GPU", device_text(agg) or "—"))
    facts.append(("GPU memory", f"{format_value('gpu_gib', gib)} GiB" if is_num(gib) else "—"))
    facts.append(("Models", ", ".join(map(str, uniq(r.model for r in runs))) or "—"))
    backends = uniq(r.backend for r in runs)
    facts.append(("Backends", ", ".join(D.backend_name(b) for b in backends) or "—"))
    dates = sorted(uniq([*(agg.run_dates or []), *(r.started_at for r in runs)]), key=str)
    if dates:
        facts.append(("Run dates", str(dates[0]) if len(dates) == 1 else f"{dates[0]} … {dates[-1]}"))
    for key, name in (("kvexp_version", "kvexp version"), ("schema_version", "Schema version")):
        if getattr(agg, key) is not None:
            facts.append((name, str(getattr(agg, key))))

    env_table = None
    env = agg.environment.to_json() if agg.environment is not None else {}
    if env:  # every fact it holds, as it holds them
        env_table = Table(["Key", "Value"], [[str(k), _plain(v)] for k, v in env.items()], kind="kv")

    backend_rows = []
    for b in backends:
        br = [r for r in runs if r.backend == b]
        versions = ", ".join(map(str, uniq(r.backend_version for r in br)))
        backend_rows.append([D.backend_name(b), versions or "—", str(len(br))])
    backend_table = Table(["Backend", "Version", "Runs"], backend_rows, [False, False, True])

    run_rows = []
    any_tool = any(r.tool for r in runs)
    for r in runs:
        kv = r.kv
        reused = r.reused_server
        run_rows.append([
            r.label, tool_name(r) if any_tool else "—", r.backend_name,
            str(r.backend_version or "—"),
            str(r.model or "—"), r.weights_text, str(r.scenario or "—"), kv.display,
            _output_length(r),
            r.state, str(r.started_at or "—"),
            "—" if reused is None else ("reused" if reused else "launched"),
        ])
    run_table = drop_empty(Table(["Run", "Measured by", "Backend", "Version", "Model", "Weights", "Scenario", "KV",
                                  "Output length", "Status", "Started", "Server"], run_rows, kind="wide"))

    kv_rows = []
    for r in runs:
        kv = r.kv_cache
        k, v = kv.dtype_k, kv.dtype_v
        src = kv.source
        unconfirmed = not kv.dtype and r.kv_requested and not r.tool and r.levels
        kv_rows.append([
            r.label, str(r.kv_requested or "—"),
            "— (not confirmed)" if unconfirmed else format_value("dtype", kv.dtype),
            "—" if not (k or v) else f"{k or '—'} / {v or '—'}",
            format_value("blocks", kv.blocks), format_value("block_size", kv.block_size),
            format_value("capacity_tokens", kv.capacity),
            format_value("kv_gib", _gib(kv.bytes)),
            # a share of GPU memory means nothing on a run without a GPU (vLLM's CPU build still reports one)
            format_value("gpu_memory_utilization", kv.gpu_memory_utilization if r.gpu else None),
            _max_concurrency(r),
            ", ".join(map(str, src)) if isinstance(src, list) else format_value("source", src),
        ])
    # Runs whose server reported nothing about its KV cache are named in one line, not a row of dashes.
    kv_unreported = [row[0] + (f" (requested {row[1]})" if row[1] != "—" else "") for row in kv_rows
                     if all(c == "—" for c in row[2:])]
    kv_rows = [row for row in kv_rows if not all(c == "—" for c in row[2:])]
    kv_table = drop_empty(Table(["Run", "Requested", "Dtype", "K / V", "Blocks", "Block size", "Capacity (tokens)",
                      "KV memory (GiB)", "GPU mem. util. (%)", "Max concurrency", "Source"], kv_rows,
                     [False, False, False, False, True, True, True, True, True, True, False], kind="wide")) \
        if kv_rows else None

    scen_rows = []
    for scen, sruns in agg.scenarios():
        xs: dict[str, set[float]] = {}
        for r in sruns:
            for lv in r.levels:
                x = lv.x
                if x:
                    xs.setdefault(x[0], set()).add(x[1])
        levels = "; ".join(f"{D.x_words(k)} {', '.join(format_value(k, x) for x in sorted(v))}"
                           for k, v in sorted(xs.items())) or "—"
        prompts = ", ".join(format_value("prompt_tokens", p) for p in uniq(r.prompt_tokens for r in sruns))
        maxes = ", ".join(format_value("max_tokens", p) for p in uniq(r.max_tokens for r in sruns))
        ran = sum(r.state != "skipped" for r in sruns)  # a skipped job is no run
        scen_rows.append([scen, prompts or "—", maxes or "—", levels,
                          str(ran) + (f" ({len(sruns) - ran} skipped)" if ran < len(sruns) else "")])
    scen_table = Table(["Scenario", "Prompt tokens", "Max tokens", "Levels", "Runs"], scen_rows,
                       [False, True, True, False, True])

    launches = []
    for r in runs:
        cmd = r.launch_command
        if cmd:
            text = shlex.join(map(str, cmd)) if isinstance(cmd, list) else str(cmd)
            launches.append({"label": r.label, "command": text,
                             "reused": bool(r.reused_server)})
    return {"facts": facts, "environment": env_table, "backends": backend_table, "runs": run_table,
            "foreign": foreign_view(runs),
            "kv": kv_table, "kv_unreported": kv_unreported, "scenarios": scen_table, "launches": launches,
            "kv_label_note": any(r.kv.source == "label" for r in runs)}


def foreign_view(runs: list[Run]) -> list[dict]:
    """Per tool: its runs, their files, what it does not record and how its definitions differ."""
    out: dict[str, dict] = {}
    for r in runs:
        if not r.tool:
            continue
        t = out.setdefault(str(r.tool), {"tool": str(r.tool), "rows": [], "notes": [], "not_recorded": []})
        t["rows"].append([r.label, tool_name(r), str(r.source or "—")])
        t["notes"] += [n for n in r.tool_notes or [] if n not in t["notes"]]
        t["not_recorded"] += [k for k in r.not_recorded or [] if k not in t["not_recorded"]]
    for t in out.values():
        t["table"] = Table(["Run", "Tool", "Files"], t.pop("rows"), kind="wide")
        t["not_recorded"] = ", ".join(t["not_recorded"])
    return list(out.values())



def _max_concurrency(run: Run) -> str:
    """One figure for a run's max concurrency: the planner's (requests of this scenario's size before
    preemption, as findings quote it), with the server's own beside it where it differs and why (vLLM
    sizes its figure for requests of its full context)."""
    ours = run.planner.max_concurrency_before_preemption if run.planner is not None else None
    theirs = run.kv_cache.max_concurrency
    if not is_num(ours):
        return format_value("max_concurrency", theirs)
    text = format_value("max_concurrency", ours)
    if is_num(theirs) and format_value("max_concurrency", theirs) != text:
        text += f" (server: {format_value('max_concurrency', theirs)} for requests of its full context)"
    return text
