"""Composing a command line's jobs: Hydra's compose API over conf/, comma lists expanded into one job
each, Hydra's and OmegaConf's errors as one line, the unsupported-pair rule (check) and the keys that
only some backends of a sweep declare."""

from __future__ import annotations

import dataclasses
import itertools
import re
import warnings
from pathlib import Path
from typing import Any, Iterable, Optional

from omegaconf import OmegaConf, open_dict

from kvexp.app.checks import check_config, check_endpoint, check_host, register_configs
from kvexp.app.helptext import defaults
from kvexp.backends import REGISTRY
from kvexp.core import config as schemas
from kvexp.core.config import ConfigError, ExperimentConfig, KVConfig, skips_unsupported
from kvexp.core.paths import data_dir

GROUPS = ("backend", "model", "kv", "scenario", "gpu")


def safe_name(text: str) -> str:
    """A label made safe for a file name."""
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", str(text)).strip("._") or "job"


OWN_MODEL = "own"  # conf/model/own.yaml: the model a `model.gguf=` or `model.hf=` alone names
MODEL_FILE_KEYS = ("model.gguf", "model.hf")


def own_model_name(gguf: Optional[str], hf: Optional[str]) -> str:
    """The name of a model given by its file alone: the GGUF's file name (a split file's without its
    -00001-of-00003), the folder's (a hub-cache snapshot: its repository's), or a hub id itself (what
    `vllm serve ID` serves it as, so that a server attached to answers to it)."""
    for value in (gguf, hf):
        if value and not str(value).startswith("@"):
            p = Path(str(value).rstrip("/"))
            if value is hf and "/" in str(value) and not str(value).startswith(("/", ".", "~")) and not p.exists():
                return str(value)
            if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
                p = Path(p.parent.parent.name.split("--")[-1])
            name = re.sub(r"-\d{5}-of-\d{5}$", "", p.stem if p.suffix == ".gguf" else p.name)
            if name:
                return name
    return OWN_MODEL


def _resolvers() -> None:
    """OmegaConf's resolvers kvexp's conf/ uses (idempotent): `safe` for folder names, and the name of a
    model given by its file (conf/model/own.yaml), which every process that builds a job's config needs."""
    if not OmegaConf.has_resolver("safe"):
        OmegaConf.register_new_resolver("safe", safe_name)
    if not OmegaConf.has_resolver("kvexp_model_name"):
        OmegaConf.register_new_resolver("kvexp_model_name", own_model_name)


def setup_hydra() -> None:
    """Register kvexp's schemas and resolvers with Hydra/OmegaConf (idempotent; called before anything
    composes a config, never at import)."""
    _resolvers()
    register_configs()
    hide_schema_notice()


def own_model(overrides: list[str]) -> list[str]:
    """`model.gguf=PATH` or `model.hf=DIR` without a `model=`: the model is the file's own (model=own),
    not the default preset's with another file, so nothing of another model's architecture is planned."""
    keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o and not o.startswith("~")}
    if "model" in keys or not keys & set(MODEL_FILE_KEYS):
        return list(overrides)
    return [f"model={OWN_MODEL}", *overrides]


def hide_schema_notice() -> None:
    """Hide Hydra's notice that conf/hydra/launcher/submitit_slurm.yaml is checked against the launcher's
    schema of the same name (deprecated in Hydra 1.1, harmless in 1.3); every other warning still shows."""
    warnings.filterwarnings("ignore", message=r"\s*'hydra/launcher/submitit_slurm' is validated against ConfigStore "
                            "schema with the same name", category=UserWarning)


# ---------------------------------------------------------------- composing and checking configs
def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (data_dir("conf") / group).glob("*.yaml"))


def kv_choices() -> dict[str, KVConfig]:
    out = {}
    for name in _options("kv"):
        node = OmegaConf.merge(OmegaConf.structured(KVConfig),
                               {k: v for k, v in OmegaConf.load(data_dir("conf") / "kv" / f"{name}.yaml").items()
                                if k != "defaults"})
        out[name] = OmegaConf.to_object(node)
    return out


def printable(text: str) -> str:
    """text with every character a terminal would act on (a newline, ESC, a bidi override) written as its
    escape, so that an error quoting what was typed stays one harmless line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def one_line_error(e: BaseException) -> str:
    """Hydra's and OmegaConf's multi-line errors, as one line naming the key and the allowed values."""
    if type(e).__name__ == "OverrideParseException" and getattr(e, "override", None):
        return _unparsable(str(e.override), str(getattr(e, "message", "") or e))
    cause = e.__cause__ or e
    m = re.search(r"Could not find '(\w+)/([^']*)'", f"{e}\n{cause}")
    if m and m.group(1) in GROUPS:
        pairs = " (or a K/V pair <K>/<V> of two of them for llama.cpp, e.g. q8_0/q4_0)" if m.group(1) == "kv" else ""
        return (f"{m.group(1)}={m.group(2)}: no such option; allowed values are "
                f"{', '.join(_options(m.group(1)))}{pairs}")
    text = str(cause).strip()
    first = text.splitlines()[0] if text else type(cause).__name__
    full = getattr(cause, "full_key", None)
    m = re.match(r"Invalid value '(.*)', expected one of \[(.*)\]$", first)
    if m and full:  # an enum field (config.py): the same shape as every other refused value
        return f"{full}={m.group(1)!r}: allowed values are {m.group(2)}"
    m = re.match(r"Key '([^']+)' not in '(\w+)'", first)
    if m:
        classes = {a.config_class.__name__: a.config_class for a in REGISTRY.values()}
        schema = getattr(schemas, m.group(2), None) or classes.get(m.group(2))
        keys = sorted(f.name for f in dataclasses.fields(schema)) if dataclasses.is_dataclass(schema) else []
        return f"{full or m.group(1)}: unknown key; allowed keys are {', '.join(keys)}"
    return f"{full}: {first}" if full else first


def _unparsable(override: str, message: str) -> str:
    """An override Hydra's grammar cannot read (a character such as ! or an unclosed bracket), as one line;
    a host says what a host may be."""
    key, _, value = override.partition("=")
    if key.lstrip("+~") in ("backend.host", "backend.endpoint"):
        try:
            (check_host if key.lstrip("+~") == "backend.host" else check_endpoint)(key.lstrip("+~"), value)
        except ConfigError as e:
            return str(e)
    first = (message.strip().splitlines() or [""])[0]
    why = "a character the override grammar does not allow" if first.startswith("LexerNoViableAlt") else first
    return (f"{override}: Hydra cannot parse this override ({why}); allowed: a value of letters, digits and "
            f"_-./:, or one in quotes, e.g. {key}='{value}'")


# Hydra's own flags, which kvexp passes on: with a value (given as `--flag value` or `--flag=value`; None:
# any value), without one, and those kvexp refuses (its configuration is its own)
# Hydra settings of where a job writes that kvexp decides itself: each job's folder in a sweep, and the
# .hydra/ folder a resume reads
_FOLDER_KEYS = {"hydra.sweep.subdir": "kvexp names each job's folder of a sweep itself (N_backend-model-kv-scenario), "
                "so that no two jobs share one", "hydra.output_subdir": "a resume reads what Hydra saves there "
                "(.hydra/)", "hydra.job.chdir": "kvexp's paths are relative to where it was started",
                "output_dir": "kvexp sets it to the job's folder; choose that with hydra.run.dir (hydra.sweep.dir "
                "with -m)"}
_VALUED = {**dict.fromkeys(("--cfg", "-c"), ("job", "hydra", "all")), **dict.fromkeys(("--package", "-p"), None)}
_OPTIONAL = {**dict.fromkeys(("--info", "-i"), ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath"))}
_BARE = ("-m", "--multirun", "--run", "-r", "--resolve")
_MODES = ("-m", "--multirun", "--run", "-r", "--cfg", "-c", "--info", "-i")
_REFUSED = ("--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd", "--experimental-rerun")


def hydra_argv(argv: list[str]) -> list[str]:
    """A run's command line as Hydra's parser reads it: its flags first (Hydra takes no override after
    one), each flag's value joined to it (`--cfg job` is `--cfg=job`, not an override `job`). A flag
    kvexp does not pass on is refused (ConfigError)."""
    flags, overrides, i = [], [], 0
    while i < len(argv):
        a = argv[i]
        i += 1
        if a in ("-", "") or a.startswith("="):
            raise ConfigError(f"{a!r}: not an override (key=value) or an option")
        if not a.startswith("-"):
            overrides.append(a)
            continue
        name, eq, value = a.partition("=")
        if name in _REFUSED:
            raise ConfigError(f"{a}: kvexp composes its own configuration (conf/ in the package); choose its "
                              "groups with overrides instead, e.g. backend=vllm kv=fp8")
        if name in _VALUED or name in _OPTIONAL:
            choices = _VALUED.get(name, _OPTIONAL.get(name))
            nxt = argv[i] if not eq and i < len(argv) else None  # its value, unless that is an override
            takes_next = nxt is not None and (nxt in (choices or ()) or (name in _VALUED and "=" not in nxt))
            if takes_next:
                value, i = argv[i], i + 1
            shown = f"{name} {value}" if value else name
            if name in _VALUED and not value:
                raise ConfigError(f"{shown}: needs a value" + (f" ({', '.join(choices)})" if choices else ""))
            if value and choices is not None and value not in choices:
                raise ConfigError(f"{shown}: allowed values are {', '.join(choices)}")
            # a bare --info takes its default, so that Hydra's parser does not take the next override for it
            flags.append(f"{name}={value}" if value else f"{name}=all" if name in _OPTIONAL else name)
        elif name in _BARE and not eq:
            flags.append(a)
        else:
            raise ConfigError(f"{a}: not an option of a run (options: -m, --cfg job|hydra|all, --resolve, "
                              "--info, --help, --version; see python -m kvexp --help)")
    overrides = own_model(overrides)
    multirun = any(f in ("-m", "--multirun") for f in flags)
    used = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    keys = {o.lstrip("+~").partition("=")[0] for o in overrides}
    for o in overrides:
        key, _, value = o.lstrip("+~").partition("=")
        if key in _FOLDER_KEYS:
            raise ConfigError(f"{o}: {_FOLDER_KEYS[key]}")
        if key in ("hydra.run.dir", "hydra.sweep.dir"):
            if not value.strip(" '\""):
                raise ConfigError(f"{o}: give a folder (an empty one would be the current folder)")
            if key != used and used not in keys:  # the only folder given is one this mode does not write into
                raise ConfigError(f"{o}: a {'sweep (-m)' if multirun else 'single run'} writes into {used}, so "
                                  f"{key} would be ignored")
    modes = [f.partition("=")[0] for f in flags if f.partition("=")[0] in _MODES]
    if len(modes) > 1:
        raise ConfigError(f"{' and '.join(modes)}: a run takes one of -m, --run, --cfg and --info "
                          "(to see a job's config, give --cfg job without -m and one value per key)")
    return [*flags, *overrides]


# backend keys that only set up a server kvexp launches (an attached one is as its owner started it)
LAUNCH_ONLY = ("host", "port", "stop_grace_s", "extra_args", "env", "binary", "python", "threads", "n_gpu_layers",
               "enforce_eager", "flash_attn", "flash_attention", "kv_rotation", "dtype", "block_size",
               "gpu_memory_utilization", "kv_cache_memory_bytes")


def refuse_unread(overrides: list[str], jobs: list[tuple[list[str], ExperimentConfig]]) -> None:
    """A setting no job would read is refused, naming why: a model file for a backend no job runs
    (model.hf with backend=llamacpp), and a launch setting for a job that attaches to a running server
    (backend.endpoint)."""
    served = {REGISTRY[cfg.backend.name].served_field(cfg.model) for _, cfg in jobs}
    for o in overrides:
        key = o.lstrip("+~").split("=", 1)[0]
        field = key.split(".", 1)[1] if key.startswith("model.") else None
        if field in ("gguf", "hf", "ollama") and field not in served:
            backends_ = sorted({cfg.backend.name for _, cfg in jobs})
            raise ConfigError(f"{key}: no job of this run serves it (backend={','.join(backends_)} serves model."
                              f"{'/'.join(sorted(served))}); drop it, or add the backend that serves it")
    for job_overrides, cfg in jobs:
        if not cfg.backend.endpoint:
            continue
        for o in overrides:
            key = o.lstrip("+~").split("=", 1)[0]
            parts = key.split(".")
            if len(parts) > 1 and parts[0] == "backend" and parts[1] in LAUNCH_ONLY:
                raise ConfigError(f"{key}: sets up a server kvexp launches, but backend.endpoint="
                                  f"{cfg.backend.endpoint} attaches to one already running, which kvexp does not "
                                  "restart or reconfigure; drop one of the two")


def refuse_repeats(overrides: list[str]) -> None:
    """A key given twice (`kv=fp16 kv=q8_0`): Hydra would silently take the last; one line instead."""
    seen: dict[str, str] = {}
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key in seen:
            raise ConfigError(f"{seen[key]} and {o}: {key} is given twice and only the last would count; give it "
                              f"once (one job per value is a sweep: -m {key}=a,b)")
        seen[key] = o


def sweep_lists(overrides: list[str]) -> list[str]:
    """The overrides that are comma lists (a sweep: one job per value, which needs -m)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return [o.input_line for o in OverridesParser.create().parse_overrides(overrides) if o.is_sweep_override()]


def sweep_overrides(overrides: list[str]) -> list[list[str]]:
    """Expand comma lists (multirun sweeps) into one override list per job."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    axes = []
    for o in parsed:
        if o.is_sweep_override():
            values = list(o.sweep_string_iterator())
            twice = sorted({v for v in values if values.count(v) > 1})
            if twice:  # the same job twice, and a report comparing it with itself
                raise ConfigError(f"{o.input_line}: {twice[0]} is given twice; each value is one job (repeat a "
                                  "job's levels with scenario.repeats)")
            axes.append([f"{o.get_key_element()}={v}" for v in values])
        else:
            axes.append([o.input_line])
    return [list(c) for c in itertools.product(*axes)] if axes else [[]]


def compose(overrides: list[str]) -> ExperimentConfig:
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    setup_hydra()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(data_dir("conf")), version_base="1.3"):
        node = hydra_compose(config_name="config", overrides=overrides)
    return to_experiment(node)


def default_folder(overrides: list[str], multirun: bool) -> Path:
    """The folder Hydra would write a run (or sweep) into, resolved now (its name holds the time)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(data_dir("conf")), version_base="1.3"):
        node = hydra_compose(config_name="config", overrides=overrides, return_hydra_config=True)
        return Path(str(OmegaConf.select(node, "hydra.sweep.dir" if multirun else "hydra.run.dir")))


def to_experiment(node: Any) -> ExperimentConfig:
    """The typed config of a composed node (Hydra's own `hydra` node, if there, left out)."""
    _resolvers()  # a job's own process (Slurm, Ray) resolves its model's name here
    if "hydra" in node:
        node = node.copy()  # a copy keeps the schema (masked_copy would make it a plain dict)
        with open_dict(node):
            node.pop("hydra")
    return OmegaConf.to_object(node)


SLURM_LAUNCHERS = ("submitit_slurm", "kvexp_slurm")  # conf/hydra/launcher/, hydra_plugins/kvexp_launcher/


def check_launcher(overrides: list[str]) -> None:
    """A launcher that cannot submit here, refused before any folder is made: submitit's without kvexp's
    `cluster` extra (Hydra said "Unknown plugin class" in a 25-line traceback), a Slurm one on a machine
    without Slurm's commands (submitit's traceback)."""
    import importlib.util
    import shutil

    chosen = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+~") == "hydra/launcher"]
    name = chosen[-1] if chosen else ""
    if name.startswith("submitit") or name in SLURM_LAUNCHERS:
        try:
            there = all(importlib.util.find_spec(m) is not None
                        for m in ("submitit", "hydra_plugins.hydra_submitit_launcher"))
        except (ImportError, ValueError):
            there = False
        if not there:
            raise ConfigError(f"hydra/launcher={name}: needs kvexp's cluster extra (hydra-submitit-launcher, "
                              "submitit): pip install 'kvexp[cluster]'")
    if name in SLURM_LAUNCHERS:
        gone = [p for p in ("sbatch", "srun") if shutil.which(p) is None]
        if gone:
            raise ConfigError(f"hydra/launcher={name}: {' and '.join(gone)} not found on PATH: submit from a machine "
                              "of a Slurm cluster (a login node), or run the jobs here with "
                              "hydra/launcher=submitit_local")


def compose_all(overrides: list[str]) -> list[tuple[list[str], ExperimentConfig]]:
    """Every job of a sweep, composed (a backend-only key set for the jobs whose backend declares it,
    see backend_only_keys); raises ConfigError with one line."""
    check_launcher(overrides)
    overrides, partial = backend_only_keys(own_model(overrides))
    try:
        combos = sweep_overrides(overrides)
        lists = sweep_lists(overrides)
    except Exception as e:
        raise ConfigError(one_line_error(e)) from None
    out = []
    for combo in combos:
        try:
            cfg = compose(combo)
        except ConfigError:
            raise
        except Exception as e:
            raise ConfigError(one_line_error(e)) from None
        cfg._sweep_lists = lists  # what check() refuses without -m (a private attribute: never written out)
        out.append((combo, drop_backend_only(cfg, partial)))
    return out


def check(cfg: ExperimentConfig, kvs: dict[str, KVConfig], multirun: bool = False,
          serves: bool = True) -> Optional[str]:
    """None when the job can run; the reason when it is an unsupported backend/kv pair to skip (in a
    sweep by default, anywhere with unsupported=skip). Raises ConfigError for anything else, a comma list
    without -m included (Hydra would answer it with a 4-line "Ambiguous value")."""
    lists = getattr(cfg, "_sweep_lists", None)
    if lists and not multirun:
        key, _, value = lists[0].partition("=")
        raise ConfigError(f"{lists[0]}: a comma list runs one job per value, a sweep: allowed with -m (python -m "
                          f"kvexp -m {lists[0]} ...), or give one value, or quote it to set a string: {key}='{value}'")
    try:
        check_config(cfg, kvs, serves)
    except ConfigError as e:
        if skips_unsupported(cfg.unsupported, multirun) and str(e).startswith("kv="):
            return str(e)
        raise
    return None


# ---------------------------------------------------------------- keys only some backends declare
def _field(override: str) -> Optional[str]:
    """The backend field an override sets (`backend.python=...`, `+backend.env.X=...` -> python, env)."""
    key = override.split("=", 1)[0].lstrip("+~")
    head, dot, rest = key.partition(".")
    return rest.split(".", 1)[0] if head == "backend" and dot and rest else None


def _declared(backend: str) -> Optional[set[str]]:
    adapter = REGISTRY.get(backend)
    return {f.name for f in dataclasses.fields(adapter.config_class)} if adapter else None


def sweep_backends(combos: list[list[str]]) -> list[str]:
    """The backends a sweep's jobs run, in order (conf/config.yaml's default where a job names none)."""
    default = defaults().get("backend", "")
    out: list[str] = []
    for combo in combos:
        named = [o.split("=", 1)[1] for o in combo if "=" in o and o.split("=", 1)[0].lstrip("+") == "backend"]
        name = named[-1] if named else default
        if name not in out:
            out.append(name)
    return out


def backend_only_keys(overrides: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """A sweep over several backends may set a `backend.KEY` that only some of them declare (e.g.
    backend.python, vLLM's): such an override becomes `++backend.KEY=...`, which Hydra adds to the other
    backends' configs too, and drop_backend_only removes it there. Returns the overrides to compose and
    run, and {KEY: the backends that declare it} for each such key. A key no backend of the sweep
    declares is left as it is, and composing refuses it with one line."""
    try:
        backends = sweep_backends(sweep_overrides(overrides))
    except Exception:  # noqa: BLE001 (a malformed override: composing reports it with one line)
        return list(overrides), {}
    found = {b: _declared(b) for b in backends}
    declared = {b: keys for b, keys in found.items() if keys is not None}
    if len(backends) < 2 or len(declared) < len(backends):  # one backend, or an unknown one: compose says
        return list(overrides), {}
    partial: dict[str, list[str]] = {}
    out = []
    for o in overrides:
        name = _field(o) if "=" in o and not o.startswith("~") else None
        owners = [b for b in backends if name in declared[b]] if name else []
        if name and owners and len(owners) < len(backends):
            partial[name] = owners
            o = "++" + o.lstrip("+")
        out.append(o)
    return out, partial


def drop_backend_only(cfg: ExperimentConfig, keys: Iterable[str]) -> ExperimentConfig:
    """Remove from cfg.backend the keys of `keys` its own schema does not declare (set by a
    `++backend.KEY` that backend_only_keys made for the other backends of the sweep)."""
    declared = {f.name for f in dataclasses.fields(cfg.backend)}
    for key in keys:
        if key not in declared and key in vars(cfg.backend):
            delattr(cfg.backend, key)
    return cfg


def ignored_keys_note(partial: dict[str, list[str]], backends: list[str]) -> list[str]:
    """One line per backend-only key of a sweep: which backends it is ignored for."""
    return [f"backend.{key} is a key of backend={', '.join(owners)} only: ignored for the "
            f"{', '.join(b for b in backends if b not in owners)} jobs" for key, owners in sorted(partial.items())]
