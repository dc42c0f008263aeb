"""The report's setup section: the machine, the backends and their versions, every run (and which tool
measured it), the KV cache as each server reported it, the scenarios, the environment and the launch
commands; and the report's default title."""

from __future__ import annotations

import re
import shlex
from typing import Any, Optional

from kvexp.analysis import documents as D
from kvexp.metrics.levels import level_x
from kvexp.metrics.registry import format_value, is_num
from kvexp.report.tables import Table, drop_empty, tool_name, uniq


def _short_model(model: Any) -> str:
    s = str(model or "—")
    return s.rsplit("/", 1)[-1] if s.startswith(("/", ".")) else s


def _gib(v: Any) -> Optional[float]:
    return v / 2**30 if is_num(v) else None


def device_text(aggregate: dict) -> Optional[str]:
    """The GPU(s) of the runs; "CPU only: <model>" when no run had a GPU and the environment names the
    CPU; None when neither is known."""
    gpus = uniq([aggregate.get("gpu"), *(r.get("gpu") for r in aggregate.get("runs") or [])])
    if gpus:
        return ", ".join(map(str, gpus))
    cpu = (aggregate.get("environment") or {}).get("cpu") if isinstance(aggregate.get("environment"), dict) else None
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


def default_title(aggregate: dict) -> str:
    """"kvexp comparison — <device> — <model> (llama.cpp: GGUF Q4_1; vLLM: bfloat16)": each model named once,
    with each backend's weights beside it where backends served it from different files."""
    gpu = device_text(aggregate) or "unknown GPU"
    runs = [r for r in aggregate.get("runs") or [] if D.run_status(r) != "skipped"]
    models = uniq(_model_stem(r.get("model")) for r in runs)
    if len(models) == 1:
        served = uniq(f"{D.backend_name(r.get('backend'))}: {D.weights_display(r)}" for r in runs)
        files = uniq(_short_model(r.get("model")) for r in runs)
        what = models[0] + (f" ({'; '.join(served)})" if len(files) > 1 else "")
    else:
        what = ", ".join(models) if 0 < len(models) <= 3 else f"{len(models)} models" if models else "no runs"
    return f"kvexp comparison — {gpu} — {what}"


def kv_capacity(kv: dict) -> Optional[float]:
    """The KV tokens a server reported: its capacity, else blocks x block size; None when unknown."""
    if is_num(kv.get("capacity_tokens")):
        return float(kv["capacity_tokens"])
    if is_num(kv.get("blocks")) and is_num(kv.get("block_size")):
        return float(kv["blocks"] * kv["block_size"])
    return None


def _output_length(run: dict) -> str:
    flag = run.get("variable_length")
    if flag is True:
        return "capped"
    if flag is False:
        return "forced"
    return "capped (assumed)" if D.caps_output_only(run) else "—"


def setup_view(agg: dict) -> dict:
    """The setup section's facts and tables, as strings."""
    runs = list(agg.get("runs") or [])
    facts: list[tuple[str, str]] = []
    gib = agg.get("gpu_gib")
    facts.append(("GPU", device_text(agg) or "—"))
    facts.append(("GPU memory", f"{format_value('gpu_gib', gib)} GiB" if is_num(gib) else "—"))
    facts.append(("Models", ", ".join(map(str, uniq(r.get("model") for r in runs))) or "—"))
    backends = uniq(r.get("backend") for r in runs)
    facts.append(("Backends", ", ".join(D.backend_name(b) for b in backends) or "—"))
    dates = sorted(uniq([*(agg.get("run_dates") or []), *(r.get("started_at") for r in runs)]), key=str)
    if dates:
        facts.append(("Run dates", str(dates[0]) if len(dates) == 1 else f"{dates[0]} … {dates[-1]}"))
    for key, name in (("kvexp_version", "kvexp version"), ("schema_version", "Schema version")):
        if agg.get(key) is not None:
            facts.append((name, str(agg[key])))

    env_table = None
    env = agg.get("environment")
    if isinstance(env, dict) and env:
        env_table = Table(["Key", "Value"], [[str(k), _plain(v)] for k, v in env.items()], kind="kv")

    backend_rows = []
    for b in backends:
        br = [r for r in runs if r.get("backend") == b]
        versions = ", ".join(map(str, uniq(r.get("backend_version") for r in br)))
        backend_rows.append([D.backend_name(b), versions or "—", str(len(br))])
    backend_table = Table(["Backend", "Version", "Runs"], backend_rows, [False, False, True])

    run_rows = []
    any_tool = any(r.get("tool") for r in runs)
    for r in runs:
        kv = D.kv_name(r)
        reused = r.get("reused_server")
        run_rows.append([
            str(r.get("label")), tool_name(r) if any_tool else "—", D.backend_name(r.get("backend")),
            str(r.get("backend_version") or "—"),
            str(r.get("model") or "—"), D.weights_display(r), str(r.get("scenario") or "—"), kv.display,
            _output_length(r),
            D.run_status(r), str(r.get("started_at") or "—"),
            "—" if reused is None else ("reused" if reused else "launched"),
        ])
    run_table = drop_empty(Table(["Run", "Measured by", "Backend", "Version", "Model", "Weights", "Scenario", "KV",
                                  "Output length", "Status", "Started", "Server"], run_rows, kind="wide"))

    kv_rows = []
    for r in runs:
        kv = r.get("kv_cache") or {}
        k, v = kv.get("dtype_k"), kv.get("dtype_v")
        src = kv.get("source")
        unconfirmed = not kv.get("dtype") and r.get("kv_requested") and not r.get("tool") and r.get("levels")
        kv_rows.append([
            str(r.get("label")), str(r.get("kv_requested") or "—"),
            "— (not confirmed)" if unconfirmed else format_value("dtype", kv.get("dtype")),
            "—" if not (k or v) else f"{k or '—'} / {v or '—'}",
            format_value("blocks", kv.get("blocks")), format_value("block_size", kv.get("block_size")),
            format_value("capacity_tokens", kv_capacity(kv)),
            format_value("kv_gib", _gib(kv.get("bytes"))),
            # a share of GPU memory means nothing on a run without a GPU (vLLM's CPU build still reports one)
            format_value("gpu_memory_utilization", kv.get("gpu_memory_utilization") if r.get("gpu") else None),
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
    for scen, sruns in D.scenarios(agg):
        xs: dict[str, set[float]] = {}
        for r in sruns:
            for lv in r.get("levels") or []:
                x = level_x(lv)
                if x:
                    xs.setdefault(x[0], set()).add(x[1])
        levels = "; ".join(f"{D.x_words(k)} {', '.join(format_value(k, x) for x in sorted(v))}"
                           for k, v in sorted(xs.items())) or "—"
        prompts = ", ".join(format_value("prompt_tokens", p) for p in uniq(r.get("prompt_tokens") for r in sruns))
        maxes = ", ".join(format_value("max_tokens", p) for p in uniq(r.get("max_tokens") for r in sruns))
        ran = sum(D.run_status(r) != "skipped" for r in sruns)  # a skipped job is no run
        scen_rows.append([scen, prompts or "—", maxes or "—", levels,
                          str(ran) + (f" ({len(sruns) - ran} skipped)" if ran < len(sruns) else "")])
    scen_table = Table(["Scenario", "Prompt tokens", "Max tokens", "Levels", "Runs"], scen_rows,
                       [False, True, True, False, True])

    launches = []
    for r in runs:
        cmd = r.get("launch_command")
        if cmd:
            text = shlex.join(map(str, cmd)) if isinstance(cmd, list) else str(cmd)
            launches.append({"label": str(r.get("label")), "command": text,
                             "reused": bool(r.get("reused_server"))})
    return {"facts": facts, "environment": env_table, "backends": backend_table, "runs": run_table,
            "foreign": foreign_view(runs),
            "kv": kv_table, "kv_unreported": kv_unreported, "scenarios": scen_table, "launches": launches,
            "kv_label_note": any(D.kv_name(r).source == "label" for r in runs)}


def foreign_view(runs: list[dict]) -> list[dict]:
    """Per tool: its runs, their files, what it does not record and how its definitions differ."""
    out: dict[str, dict] = {}
    for r in runs:
        if not r.get("tool"):
            continue
        t = out.setdefault(str(r["tool"]), {"tool": str(r["tool"]), "rows": [], "notes": [], "not_recorded": []})
        t["rows"].append([str(r.get("label")), tool_name(r), str(r.get("source") or "—")])
        t["notes"] += [n for n in r.get("tool_notes") or [] if n not in t["notes"]]
        t["not_recorded"] += [k for k in r.get("not_recorded") or [] if k not in t["not_recorded"]]
    for t in out.values():
        t["table"] = Table(["Run", "Tool", "Files"], t.pop("rows"), kind="wide")
        t["not_recorded"] = ", ".join(t["not_recorded"])
    return list(out.values())



def _max_concurrency(run: dict) -> str:
    """One figure for a run's max concurrency: the planner's (requests of this scenario's size before
    preemption, as findings quote it), with the server's own beside it where it differs and why (vLLM
    sizes its figure for requests of its full context)."""
    kv = run.get("kv_cache") or {}
    plan = run.get("planner") if isinstance(run.get("planner"), dict) else {}
    ours, theirs = plan.get("max_concurrency_before_preemption"), kv.get("max_concurrency")
    if not is_num(ours):
        return format_value("max_concurrency", theirs)
    text = format_value("max_concurrency", ours)
    if is_num(theirs) and format_value("max_concurrency", theirs) != text:
        text += f" (server: {format_value('max_concurrency', theirs)} for requests of its full context)"
    return text
