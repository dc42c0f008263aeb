"""What `python -m kvexp --help` and `python -m kvexp plan --help` print: the subcommands, the config
groups with the options a user can pick (the YAML files in conf/, never the `*_schema` entries Hydra's
own help lists) and the keys each group sets, read from the typed schemas in kvexp.core.config."""

from __future__ import annotations

import dataclasses
import textwrap

from kvexp.assets import embedded
from kvexp.backends import REGISTRY
from kvexp.core import __version__, config as schemas
from kvexp.core.paths import data_dir

_INSTALLABLE = (*(n for n, a in REGISTRY.items() if a.installable),
                *(embedded.install_name(m) for m in embedded.WHEEL_MODELS.values()))
COMMANDS = (
    ("validate PATH...", "check files against kvexp's schemas (kvexp results, aggregates, requests.jsonl) or "
                         "that another tool's result maps to kvexp's levels; a folder: every result.json under "
                         "it; one line per file, exit 1 on any violation"),
    ("report PATH... [--out DIR] [--title T]", "comparison report (Markdown, HTML, PDF, JSON, CSV) from any mix "
                                               "of sweep folders, job folders, result files, the reference "
                                               "document and vLLM bench serve / GuideLLM / AIPerf result files"),
    ("results PATH... [--csv [OUT]]", "one row per level from the same inputs: an aligned table of the key "
                                      "figures; --csv: comparison.csv's columns (to OUT, else to standard output)"),
    ("plan [group=option ...]", "the KV-capacity planner's table for the composed jobs (comma lists allowed)"),
    (f"install [{'|'.join(_INSTALLABLE)}] [--force] [--cpu|--cuda]",
     "one-time build or install of a server kvexp launches, or of a model it brings (default: llamacpp and "
     "SmolLM2); llama.cpp and vLLM are built for CUDA where an NVIDIA driver (and, for llama.cpp, nvcc) is "
     "found, else for the CPU, said in one line; --cpu or --cuda forces it; --force builds again"),
    ("resume DIR", "finish an interrupted sweep or run folder: only what is missing is measured (a finished "
                   "folder: nothing to do)"),
    ("cleanup [--dry-run]", "stop the servers a killed kvexp left running (--dry-run: only list them)"),
)
GROUP_SCHEMAS = {
    "backend": (schemas.BackendConfig, *(a.config_class for a in REGISTRY.values())),
    "model": (schemas.ModelConfig,),
    "kv": (schemas.KVConfig,),
    "scenario": (schemas.ScenarioConfig,),
    "gpu": (schemas.GPUConfig,),
}


def defaults() -> dict[str, str]:
    """Each group's default option, as conf/config.yaml's defaults list names it."""
    from omegaconf import OmegaConf

    out = {}
    for item in OmegaConf.to_container(OmegaConf.load(data_dir("conf") / "config.yaml")).get("defaults", []):
        if isinstance(item, dict):
            out.update({str(k): str(v) for k, v in item.items()})
    return out


def options(group: str) -> list[str]:
    """The options of a config group: its YAML files (what `group=option` accepts)."""
    return sorted(p.stem for p in (data_dir("conf") / group).glob("*.yaml"))


FIXED = {"backend": {"name"}, "kv": {"name"}}  # set by the option itself


def keys(group: str) -> list[tuple[str, list[str]]]:
    """The keys `group.key=value` sets, from the group's schemas: ("", shared keys), then for a group with
    one schema per option (backend) (option, its own keys)."""
    base, *own = GROUP_SCHEMAS[group]
    shared = [f.name for f in dataclasses.fields(base) if f.name not in FIXED.get(group, set())]
    out = [("", shared)]
    for cls in own:
        out.append((cls.name, [f.name for f in dataclasses.fields(cls) if f.name not in shared
                               and f.name not in FIXED.get(group, set())]))
    return out


def _wrap(text: str, indent: int, width: int = 100) -> str:
    return textwrap.fill(text, width, initial_indent=" " * indent, subsequent_indent=" " * indent)


def _commands() -> str:
    return "\n".join(f"  {name}\n{_wrap(what, 6)}" for name, what in COMMANDS)


def _groups() -> str:
    lines = []
    chosen = defaults()
    for group in GROUP_SCHEMAS:
        lines.append(f"  {group}={{{','.join(options(group))}}}   (default {chosen.get(group, '-')})")
        for option, names in keys(group):
            head = f"keys with {group}={option}: " if option else "keys: "
            lines.append(_wrap(head + ", ".join(f"{group}.{k}" for k in names), 6))
    top = [f.name for f in dataclasses.fields(schemas.ExperimentConfig)
           if f.name not in GROUP_SCHEMAS and f.name not in ("output_dir", "client")]
    client = [f"client.{f.name}" for f in dataclasses.fields(schemas.ClientConfig)]
    lines.append(_wrap("other keys: " + ", ".join([*top, *client]) + " (unsupported=auto|error|skip: a backend/kv pair that cannot run is skipped in a sweep with auto, "
                      "the default, and refuses a single run; resume=true)", 2))
    return "\n".join(lines)


def main_help() -> str:
    return f"""kvexp {__version__}: which LLM server, KV-cache dtype and concurrency should this GPU run? Measured.

usage:
  python -m kvexp [-m] [group=option ...] [group.key=value ...]   run one job (-m: a sweep over comma lists)
  python -m kvexp COMMAND ...                                      see below; COMMAND --help for its options
  python -m kvexp --version

commands:
{_commands()}

config groups (group=option picks a file in conf/GROUP/; -m with a,b,c sweeps them):
{_groups()}

examples:
  python -m kvexp                                          SmolLM2-135M on llama-server (CPU), scenario cpu
  python -m kvexp -m backend=vllm,llamacpp kv=fp16,fp8     a sweep; pairs that cannot run are skipped, with why
                                                           (unsupported=error: refuse the sweep instead)
  python -m kvexp model.gguf=/models/my.gguf               your model, named once (its architecture from the file)
  python -m kvexp backend.endpoint=http://127.0.0.1:8080   attach to a running server
  python -m kvexp report outputs/sweeps/* vllm-results/*.json --out cmp

Hydra's own options (--cfg job, --info, hydra/launcher=...) work as in any Hydra app; --hydra-help lists them."""


def plan_help() -> str:
    return f"""usage: python -m kvexp plan [group=option ...] [group.key=value ...] [--gpus all|PRESET,...]

The KV-capacity planner's table for every job the overrides compose (comma lists expand as in a sweep):
KV bytes per token, the KV capacity each backend would get, and the concurrency at which requests start
to queue or be preempted; with the fitted overheads of ~/.cache/kvexp/calibration.json beside the
uncalibrated figures. Nothing is launched.

--gpus all|PRESET,...  what-if: the same jobs on each conf/gpu preset (also when gpu= names several):
                       KV tokens and concurrent requests of the scenario that fit before preemption
                       (vLLM) or queueing (llama.cpp, Ollama), uncalibrated and calibrated.

config groups:
{_groups()}

example:
  python -m kvexp plan model=qwen2.5-7b gpu=rtx5070ti kv=fp16,fp8 backend=vllm,llamacpp
  python -m kvexp plan model=qwen2.5-7b kv=fp16,fp8 backend=vllm --gpus l4,a100-80gb,h100"""


def wants_help(argv: list[str]) -> bool:
    return any(a in ("-h", "--help") for a in argv)
