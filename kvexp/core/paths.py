"""Where kvexp's own data folders are: the repository's top level in a source checkout, or
kvexp/_data/ in an installed wheel (pyproject ships conf/, templates/ and schema/ there); its cache;
and the one way kvexp writes a file that a reader may open at any moment."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import tempfile
from pathlib import Path
from typing import Optional

_PKG = Path(__file__).resolve().parent.parent  # kvexp/


def cache_dir() -> Path:
    """kvexp's per-machine cache (built servers, models, calibration): $KVEXP_CACHE, else
    $XDG_CACHE_HOME/kvexp, else ~/.cache/kvexp."""
    given = os.environ.get("KVEXP_CACHE")
    base = given or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvexp")
    if os.path.exists(base) and not os.path.isdir(base):  # every use would fail with "File exists" or worse
        what = ("KVEXP_CACHE names a file, not a folder: name a folder (or unset it)" if given else
                "kvexp's cache is a file, not a folder: move the file away or set KVEXP_CACHE to a folder")
        raise NotADirectoryError(errno.ENOTDIR, what, base)
    return Path(base)


def sha256_of(path: Path) -> str:
    """The sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_problem(path: Path) -> Optional[str]:
    """Why path is not a regular file kvexp can read, in a few words ("no such file", "a folder, not a
    file", ...); None when it is one."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "no such file"
    except OSError as e:
        return f"cannot be read: {e.strerror}"
    if stat.S_ISDIR(mode):
        return "a folder, not a file"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO), not a regular file"
    if not stat.S_ISREG(mode):
        return "a device or socket, not a regular file"
    if not os.access(path, os.R_OK):
        return "cannot be read: Permission denied"
    return None


def data_dir(name: str) -> Path:
    for cand in (_PKG.parent / name, _PKG / "_data" / name):
        if cand.is_dir():
            return cand
    raise FileNotFoundError(f"kvexp's {name}/ folder is missing from this installation")


def atomic_write(path: Path, data: str | bytes) -> Path:
    """Write data to path atomically: a temporary file beside it, then a rename; a reader sees the old
    file or the new one, never half of one, and an interrupted write leaves nothing behind."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror, str(path)) from None  # named by the file meant, not the temporary one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


RESERVE_BYTES = 64 << 10  # room for a job's last result.json write (its levels, status, log tail)


class SpaceReserve:
    """A small file of real blocks kept in a job folder while the job runs and removed just before its
    last result is written: when the disk fills mid-job, that write still finds room to record why
    the job failed. A folder that cannot hold it simply runs without one."""

    def __init__(self, folder: Path, size: int = RESERVE_BYTES):
        self.path: Path | None = folder / ".kvexp-reserve"
        try:
            with open(self.path, "wb") as f:
                f.write(b"\0" * size)  # written, not a sparse truncate: the blocks must be taken now
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            self.release()

    def release(self) -> None:
        if self.path is not None:
            try:
                self.path.unlink(missing_ok=True)
            except OSError:
                pass
            self.path = None
