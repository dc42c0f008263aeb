"""What every document class shares (results/documents.py, blocks.py, runs.py): `Doc`, read from JSON
(`from_json`) and written back (`to_json`), and `Block`, a producer's block written back as it was read.

A document read from a file writes back the keys it was read with (`present`) and those set since by
`update`, so that an old file, or another tool's level, goes into an aggregate as it was; one built in
code writes every field, null where unknown, but for the fields its schema does not let be null
(NOT_NULL), which it leaves out while unknown.
A field a document lacks is None: unknown, never 0."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, ClassVar, Mapping, Optional

from kvexp.metrics.levels import Level

_NAMES: dict[type, tuple[str, ...]] = {}
_MADE: dict[type, frozenset[str]] = {}


def _names(cls: type) -> tuple[str, ...]:
    names = _NAMES.get(cls)
    if names is None:
        names = _NAMES[cls] = tuple(f.name for f in fields(cls) if f.name not in ("present", "raw"))
    return names


def _made(cls: type) -> frozenset[str]:
    """A block's fields that are never None (a nested block, a list: made empty when the JSON holds null)."""
    made = _MADE.get(cls)
    if made is None:
        made = _MADE[cls] = frozenset(f.name for f in fields(cls) if f.default_factory is not MISSING)
    return made


def _out(v: Any) -> Any:
    if hasattr(v, "to_json"):
        return v.to_json()
    if isinstance(v, (list, tuple)):
        return [_out(x) for x in v]
    return v


class Doc:
    """What every document class shares: `from_json` (a JSON object in, its known keys read, nested blocks
    made typed by NESTED) and `to_json` (the keys it was read with and those `update` set, or, built in
    code, every field but the NOT_NULL ones that are unknown). Subclasses are dataclasses whose every field has a default and whose
    last field is `present` (a Block's: none, it keeps `raw`)."""

    __slots__ = ()
    NESTED: ClassVar[Mapping[str, Callable[[Any], Any]]] = {}
    NOT_NULL: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def _read(cls, d: Mapping[str, Any]) -> dict[str, Any]:
        """The fields a JSON object holds, nested blocks made typed."""
        kw: dict[str, Any] = {}
        for n in _names(cls):
            if n in d:
                v, conv = d[n], cls.NESTED.get(n)
                kw[n] = conv(v) if conv is not None and v is not None else v
        return kw

    @classmethod
    def from_json(cls, d: Any) -> Any:
        if not isinstance(d, Mapping):
            d = {}
        names = _names(cls)
        return cls(**cls._read(d), present=frozenset(k for k in d if k in names))  # type: ignore[call-arg]

    def update(self, **values: Any) -> None:
        """Set fields, which to_json then writes (a document read from a file writes the keys it was read
        with and these)."""
        for n, v in values.items():
            setattr(self, n, v)
        present: Optional[frozenset[str]] = getattr(self, "present")
        if present is not None:
            setattr(self, "present", present | frozenset(values))

    def own(self) -> Any:
        """The document made the code's own, as if built here: from now on it writes every field (null where
        unknown), and so do its blocks and levels (a resumed job's result, which the runner goes on
        filling). Returns the document."""
        setattr(self, "present", None)
        for n in _names(type(self)):
            v = getattr(self, n)
            for x in v if isinstance(v, list) else [v]:
                if isinstance(x, Doc):
                    x.own()
                elif isinstance(x, Level):
                    x.present = None
        return self

    def to_json(self) -> dict[str, Any]:
        present: Optional[frozenset[str]] = getattr(self, "present")
        out = {}
        for n in _names(type(self)):
            v = getattr(self, n)
            if (n in present) if present is not None else (v is not None or n not in self.NOT_NULL):
                out[n] = _out(v)
        return out


@dataclass(slots=True, frozen=True)
class Block(Doc):
    """A block whose shape is its producer's (results/blocks.py: the planner's prediction, the quality
    measurement, the SLO search, the workload, an aggregate's): its keys read as typed fields (a nested block or list that is null reads empty,
    where its field is not Optional), and the JSON object it was read from written back as it was, keys
    this class does not know and their order included. Read-only; a block made anew with
    dataclasses.replace (or built in code) writes its fields."""

    raw: Optional[dict[str, Any]] = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def _read(cls, d: Mapping[str, Any]) -> dict[str, Any]:
        made = _made(cls)
        return {n: v for n, v in super(Block, cls)._read(d).items() if v is not None or n not in made}

    @classmethod
    def from_json(cls, d: Any) -> Any:
        if not isinstance(d, Mapping):
            return cls()
        block = cls(**cls._read(d))
        object.__setattr__(block, "raw", d if isinstance(d, dict) else dict(d))
        return block

    def __bool__(self) -> bool:
        """Whether it holds anything: one read from an empty object, or made empty from null, is false (as its
        JSON object was)."""
        if self.raw is not None:
            return bool(self.raw)
        return any(bool(v) if isinstance(v, (Block, list, dict)) else v is not None
                   for v in (getattr(self, n) for n in _names(type(self))))

    def own(self) -> Any:
        return self  # what it writes is what it was read as

    def to_json(self) -> dict[str, Any]:
        if self.raw is not None:
            return self.raw
        return {n: _out(getattr(self, n)) for n in _names(type(self))}


def read_list(cls: Any) -> Callable[[Any], list[Any]]:
    """A converter for NESTED: a JSON list of objects, each of `cls` (an entry that is not an object is left
    out)."""
    return lambda v: [cls.from_json(x) for x in v if isinstance(x, Mapping)] if isinstance(v, list) else []


read_levels = read_list(Level)  # a document's levels, typed
