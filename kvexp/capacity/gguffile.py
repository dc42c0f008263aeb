"""A GGUF file's header, read fast and once.

`gguf.GGUFReader` maps every field of the file into numpy arrays, the tokenizer's too: on a real
model's 49k-token vocabulary that takes 4-15 s on a 2-core machine, long enough, on an event loop
between two requests, for a server to drop the client's idle pooled connections. What kvexp needs is
the scalar metadata and each tensor's shape and type: this reader walks the header with `struct`,
skips arrays without building them (a string array by its lengths), and never reads tensor data, so a
file takes milliseconds. Results are cached per (path, size, mtime), so a sweep reads a file once.

Errors are one line naming the file (`GGUFError`): a file that is not a GGUF (bad magic), an
unsupported version, a header cut short, or a file shorter than its tensors (a download that stopped)."""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAGIC = b"GGUF"
MAX_HEADER_ITEMS = 1 << 24  # a count above this is a corrupt file, not a model

# value types (gguf's GGUFValueType): fixed-size scalars as struct formats
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
MAX_ARRAY_DEPTH = 8  # arrays of arrays: llama.cpp writes none; deeper is a corrupt (or hostile) file


class GGUFError(ValueError):
    """A file kvexp cannot read as a GGUF model; the message is one line naming it."""


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF header says: scalar metadata (arrays left out, except short ones of numbers or
    strings), and the tensors' totals."""

    path: str
    version: int
    metadata: dict[str, Any]
    tensor_count: int
    n_params: int  # elements of all tensors
    n_bytes: int  # bytes of all tensors
    tensor_types: dict[str, int]  # ggml type name -> number of tensors of it
    vocab_size: int | None = None  # entries of tokenizer.ggml.tokens (None: the file holds no tokenizer)
    merges: int | None = None  # entries of tokenizer.ggml.merges (a BPE tokenizer's; None: none)


def _quant_sizes() -> dict[int, tuple[str, int, int]]:
    """ggml type id -> (name, block size, bytes per block), from the gguf package's table."""
    from gguf.constants import GGML_QUANT_SIZES  # gguf (numpy) is ~0.1 s: only once a tensor table is read

    return {int(t): (t.name, *size) for t, size in GGML_QUANT_SIZES.items()}


class _Cursor:
    def __init__(self, buf: Any, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFError(f"{self.path}: the GGUF header is cut short (truncated file?)")
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def count(self) -> int:
        n = self.take("<Q")
        if n > MAX_HEADER_ITEMS:
            raise GGUFError(f"{self.path}: the GGUF header claims {n:,} items: a corrupt file")
        return n

    def string(self) -> str:
        n = self.count()
        if self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: the GGUF header is cut short (truncated file?)")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        n = self.count()  # (not `self.pos += self.count()`: that adds to the position before the count)
        self.pos += n

    def value(self, vtype: int, keep_arrays: bool, depth: int = 0) -> Any:
        if vtype in _SCALAR:
            return self.take(_SCALAR[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise GGUFError(f"{self.path}: unknown GGUF value type {vtype}")
        if depth >= MAX_ARRAY_DEPTH:
            raise GGUFError(f"{self.path}: the GGUF header nests arrays more than {MAX_ARRAY_DEPTH} deep: "
                            "a corrupt file")
        etype, n = self.take("<I"), self.count()
        if keep_arrays and n <= 1024:  # short arrays (per-layer head counts) are kept
            return [self.value(etype, False, depth + 1) for _ in range(n)]
        if etype in _SCALAR:
            self.pos += n * struct.calcsize(_SCALAR[etype])
        elif etype == _STRING:
            for _ in range(n):
                self.skip_string()
        else:
            for _ in range(n):
                self.value(etype, False, depth + 1)
        if self.pos > len(self.buf):
            raise GGUFError(f"{self.path}: the GGUF header is cut short (truncated file?)")
        return None


def read_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """The header of a GGUF file (cached by path, size and modification time)."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        raise GGUFError(f"{p}: {e.strerror or e}") from None
    return _read(str(p), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _read(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    if size < 24:
        raise GGUFError(f"{path}: not a GGUF file ({size} bytes)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (its first bytes are {bytes(buf[:4])!r}, not b'GGUF')")
        cur = _Cursor(buf, path)
        cur.pos = 4
        version = cur.take("<I")
        if version not in (2, 3):
            raise GGUFError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_kv = cur.count(), cur.count()
        meta: dict[str, Any] = {}
        counts: dict[str, int] = {}
        for _ in range(n_kv):
            key = cur.string()
            vtype = cur.take("<I")
            if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges") and vtype == _ARRAY \
                    and cur.pos + 12 <= len(buf):
                counts[key] = struct.unpack_from("<Q", buf, cur.pos + 4)[0]  # the array's count, after its type
            value = cur.value(vtype, keep_arrays=not key.startswith("tokenizer."))
            if value is not None and not key.startswith("tokenizer.ggml."):
                meta[key] = value
        sizes = _quant_sizes()
        n_params = n_bytes = data_end = 0
        types: dict[str, int] = {}
        for _ in range(n_tensors):
            cur.skip_string()
            dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
            ttype = cur.take("<I")
            offset = cur.take("<Q")  # of the tensor's data, from the start of the data section
            elements = 1
            for d in dims:
                elements *= d
            name, block, block_bytes = sizes.get(ttype, (f"type{ttype}", 0, 0))
            tensor_bytes = elements * block_bytes // block if block else 0
            n_params += elements
            n_bytes += tensor_bytes
            data_end = max(data_end, offset + tensor_bytes)
            types[name] = types.get(name, 0) + 1
        align = meta.get("general.alignment") if isinstance(meta.get("general.alignment"), int) else 32
        need = -(-cur.pos // align) * align + data_end  # the data section starts aligned after the header
        if size < need:
            raise GGUFError(f"{path}: truncated: {size:,} bytes, but its tensors end at byte {need:,}")
    return GGUFHeader(path=path, version=version, metadata=meta, tensor_count=n_tensors,
                      n_params=n_params, n_bytes=n_bytes, tensor_types=types,
                      vocab_size=counts.get("tokenizer.ggml.tokens"), merges=counts.get("tokenizer.ggml.merges"))
