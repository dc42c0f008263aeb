"""The backends kvexp can drive: one adapter module each, registered here by name.

Adding a backend: write kvexp/backends/<name>.py (a subclass of base.Adapter, with its config
dataclass as `config_class`), add it to REGISTRY below (app/checks.register_configs stores its schema
from there), write conf/backend/<name>.yaml and its tests. Nothing else names a backend."""

from __future__ import annotations

from typing import Optional

from kvexp.backends.base import Adapter
from kvexp.backends.llamacpp import LlamaCpp
from kvexp.backends.ollama import Ollama
from kvexp.backends.vllm import VLLM
from kvexp.core.config import ConfigError, ExperimentConfig

REGISTRY: dict[str, type[Adapter]] = {a.name: a for a in (LlamaCpp, VLLM, Ollama)}


def adapter_class(name: str) -> type[Adapter]:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ConfigError(f"backend.name={name!r}: allowed values are {', '.join(REGISTRY)}") from None


def find(name: Optional[str]) -> Optional[type[Adapter]]:
    """The adapter class of a backend name read from a results document (None: not one of kvexp's)."""
    return REGISTRY.get(str(name or "").strip().lower())


def create(cfg: ExperimentConfig, locate: bool = True) -> Adapter:
    """The adapter for cfg.backend, with its program and model resolved (see Adapter.create)."""
    return adapter_class(cfg.backend.name).create(cfg, locate)


def display_name(name: Optional[str]) -> str:
    a = find(name)
    return a.display_name if a else (name or "unknown backend")
