"""A launched server's log, kept under a cap: the head (the launch and the KV cache lines), a marker line,
and the server's latest output; the lines kvexp reads back later (llama-server's per-request timings,
Ollama's runner restarts) are copied as they stream into a second capped file.

A llama-server at `-lv 4` lists its whole prompt cache at every request: 5,000 requests on the tiny model
wrote 3.8 GB, growing with the square of the requests (docs/reliability.md). The server's
stdout and stderr now go through a pipe to the keeper, a small process of its own beside the server (run
as a script, `python -I -S serverlog.py SPEC`, the pipe on its stdin; it imports the standard library
only). It writes what it reads at once (a trickle of lines gathers for at most GATHER_S), and:

- `server.log` holds the first `head_bytes` (cut at a line's end), then once the file would pass
  `max_bytes`, one line `[kvexp: N bytes of the server's log dropped here; cap log.max_mb=8]`, then the
  latest output. The file never passes `max_bytes`: when it would, the oldest half of what follows the
  marker goes (the marker's N grows), written to a temporary file and renamed over the log, so a reader
  sees the old file or the new one, never half of one.
- `server.lines.log` gets every line that matches the adapter's pattern (Adapter.log_kept), capped in
  the same way (log.lines_max_mb).

Why a process of its own, and not a thread in kvexp or the watcher: the keeper starts before the server,
so a failure to start it falls back to a plain log file before anything was launched (the watcher needs
the server's pid, so it starts after); it reads the pipe whatever kvexp is doing (a busy event loop, a
Ctrl-Z, a debugger) so the server never blocks on a full pipe; and it ends when the pipe does, that is
when every process that holds the server's output has ended: after a SIGKILL of kvexp the watcher ends
the server's processes and the keeper writes their last words and exits. Nothing waits on kvexp.

kvexp reads the files with the functions below: `written` (bytes the server has written, dropped ones
included: a mark that stays valid across a cut), `since` (what the server wrote after a mark, as far as
it is kept) and `figures` (what a result records)."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import sys
import time
from typing import Any, Optional

CHUNK = 1 << 20
PIPE_BYTES = 1 << 20  # the pipe's size kvexp asks for (Linux's default is 64 KiB; 1 MiB is what any user may set)
GATHER_S = 0.01
LONG_LINE = 1 << 16  # a partial line longer than this is no line kvexp keeps (its start is not matched)
MARKER = "[kvexp: {n} bytes of the server's {what} dropped here; cap {cap}]\n"
MARKER_RE = re.compile(rb"\[kvexp: (\d+) bytes of the server's [a-z ]+ dropped here; [^\]\n]*\]\n")
MARKER_ROOM = len(MARKER.format(n=10**20, what="kept lines", cap="")) + 64  # the longest marker, its cap named


class CappedFile:
    """A file written like an append-only log whose size stays at most max_bytes (None: no cap)."""

    def __init__(self, path: str, max_bytes: Optional[int], head_bytes: int, what: str, cap: str):
        self.path, self.max, self.head_max, self.what, self.cap = path, max_bytes, head_bytes, what, cap
        self.head = b""  # sealed at the first cut
        self.recent: Optional[bytearray] = None  # what follows the marker, from the first cut on
        self.marker = b""
        self.dropped = 0
        self.failed = 0  # bytes that could not be written (a full disk, a removed folder)
        self.error = ""
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.size = os.fstat(self.fd).st_size

    def write(self, data: bytes) -> None:
        try:
            if self.max is None or self.size + len(data) <= self.max:
                self._append(data)
            else:
                self._cut(data)
        except OSError as e:
            self.failed += len(data)
            self.error = e.strerror or str(e)

    def _append(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            if self.recent is not None:
                self.recent += view[:n]
            view = view[n:]
            self.size += n

    def _cut(self, data: bytes) -> None:
        """Keep the head and the newest half of the room after it; the rest goes, counted in the marker.
        From the first cut on, what follows the marker is also held in memory (at most max_bytes), so that a
        cut writes the new file without reading the old one."""
        assert self.max is not None
        if self.recent is None:
            if self.size < self.head_max:  # the head is the server's first head_max bytes
                n = self.head_max - self.size
                self._append(data[:n])
                data = data[n:]
            with open(self.path, "rb") as f:
                head = f.read(self.head_max)
                end = head.rfind(b"\n") + 1
                self.head = head[:end] if end else head
                f.seek(len(self.head))
                self.recent = bytearray(f.read())
        self.recent += data
        room = max(self.max - len(self.head) - MARKER_ROOM, 1)
        cut = max(len(self.recent) - room // 2, 0)
        if cut:
            nl = self.recent.find(b"\n", cut - 1)
            cut = nl + 1 if nl >= 0 and nl + 1 < len(self.recent) else cut
        del self.recent[:cut]
        self.dropped += cut
        self.marker = MARKER.format(n=self.dropped, what=self.what, cap=self.cap).encode()
        tmp = f"{self.path}.keeping"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for part in (self.head, self.marker, self.recent):
                view = memoryview(part)
                while view:
                    view = view[os.write(fd, view):]
            os.replace(tmp, self.path)
        except OSError:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(self.fd)
        self.fd = fd  # opened for appending from here
        os.lseek(fd, 0, os.SEEK_END)
        self.size = len(self.head) + len(self.marker) + len(self.recent)

    def close(self) -> None:
        if self.failed:  # said at the end, where a reader looks first
            failed, error = self.failed, self.error
            self.write(f"[kvexp: {failed} bytes of the server's {self.what} could not be written: {error}]\n".encode())
        os.close(self.fd)


class Keeper:
    """What the keeper does with each chunk the pipe gives: the log, and the lines kept whole."""

    def __init__(self, log: CappedFile, lines: Optional[CappedFile], pattern: Optional[str]):
        self.log, self.lines = log, lines
        self.pattern = re.compile(pattern.encode()) if pattern else None
        self.partial = b""
        self.skipping = False  # inside a line too long to keep

    def feed(self, chunk: bytes) -> None:
        self.log.write(chunk)
        self._match(chunk)

    def _match(self, chunk: bytes) -> None:
        if self.pattern is None or self.lines is None:
            return
        buf = self.partial + chunk
        end = buf.rfind(b"\n") + 1
        whole, self.partial = buf[:end], buf[end:]
        if self.skipping and end:
            whole = whole[whole.find(b"\n") + 1:]
            self.skipping = False
        if len(self.partial) > LONG_LINE:
            self.partial, self.skipping = b"", True
        kept, at = [], 0
        while m := self.pattern.search(whole, at):  # the pattern's own search (a literal start is found fast)
            start = whole.rfind(b"\n", 0, m.start()) + 1
            end = whole.find(b"\n", max(m.end() - 1, start)) + 1  # whole ends with a line's end
            if end <= at:  # a pattern that matches nothing of a line (an empty match at its end)
                break
            kept.append(whole[start:end])
            at = end
        if kept:
            self.lines.write(b"".join(kept))

    def close(self) -> None:
        if self.partial and not self.skipping:
            self._match(b"\n")  # the server's last line, unended: kept whole too where it matches
        for f in (self.log, self.lines):
            if f is not None:
                f.close()


def keep(fd: int, keeper: Keeper, other: Optional[int] = None) -> None:
    """Copy the server's pipe (fd) into the files until every process holding it has closed it; also
    what comes on other (the watcher's output), until the server's pipe ends. A server writes a line at a
    time: after a read that found little, the keeper lets the pipe gather for GATHER_S (the pipe holds
    PIPE_BYTES, so the server does not wait), which takes its CPU per byte down by several times."""
    fds = [fd] if other is None else [fd, other]
    while fd in fds:
        try:
            ready, _, _ = select.select(fds, [], [])
        except InterruptedError:
            continue
        got = 0
        for r in ready:
            try:
                chunk = os.read(r, CHUNK)
            except OSError:
                chunk = b""
            if chunk:
                keeper.feed(chunk)
                got += len(chunk)
            else:
                fds.remove(r)
        if 0 < got < CHUNK // 4:
            time.sleep(GATHER_S)
    keeper.close()


def spec(log: str, max_bytes: Optional[int], head_bytes: int, lines: Optional[str] = None,
         lines_max_bytes: Optional[int] = None, pattern: Optional[str] = None, other_fd: Optional[int] = None) -> str:
    """The keeper's one argument (JSON); other_fd: a second pipe to copy into the log (the watcher's output)."""
    return json.dumps({"log": log, "max_bytes": max_bytes, "head_bytes": head_bytes, "lines": lines,
                       "lines_max_bytes": lines_max_bytes, "pattern": pattern, "other_fd": other_fd})


def lines_head(head_bytes: int, lines_max_bytes: Optional[int]) -> int:
    """The head of the kept lines' file: the log's, or a quarter of its own cap where that is less."""
    return head_bytes if lines_max_bytes is None else min(head_bytes, lines_max_bytes // 4)


def mib(n: Optional[int]) -> str:
    return "none" if n is None else f"{n / (1 << 20):g}"


def main(argv: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    s = json.loads(argv[0])
    fd, other = sys.stdin.fileno(), s.get("other_fd")
    try:
        log = CappedFile(s["log"], s["max_bytes"], s["head_bytes"], "log", f"log.max_mb={mib(s['max_bytes'])}")
        lines = (CappedFile(s["lines"], s["lines_max_bytes"], lines_head(s["head_bytes"], s["lines_max_bytes"]),
                            "kept lines", f"log.lines_max_mb={mib(s['lines_max_bytes'])}")
                 if s["lines"] and s["pattern"] else None)
    except OSError:  # nowhere to write: still read, so that the server never blocks on a full pipe
        while os.read(fd, CHUNK):
            pass
        return 1
    keep(fd, Keeper(log, lines, s["pattern"]), other)
    return 0


# ---- kvexp's side: reading what the keeper wrote (an open file is one version of it: a cut renames a new one over it)

def _layout(f: Any, head_bytes: Optional[int]) -> tuple[int, int, int, int]:
    """(the file's size, where the marker starts, its length, the bytes it says were dropped) of an open
    log; (size, size, 0, 0) without a marker. Only the head's region is read."""
    size = os.fstat(f.fileno()).st_size
    if head_bytes is not None:
        f.seek(0)
        m = MARKER_RE.search(f.read(head_bytes + MARKER_ROOM))
        if m:
            return size, m.start(), m.end() - m.start(), int(m[1])
    return size, size, 0, 0


def figures(path: Any, head_bytes: Optional[int], max_bytes: Optional[int]) -> dict[str, Optional[int]]:
    """A log's bytes as a result records them: written by the server (those dropped included), on disk,
    dropped, and the cap; every count 0 for a file that is not there."""
    try:
        with open(path, "rb") as f:
            size, _, length, dropped = _layout(f, head_bytes)
    except OSError:
        size, length, dropped = 0, 0, 0
    return {"written": size - length + dropped, "on_disk": size, "dropped": dropped, "cap": max_bytes}


def written(path: Any, head_bytes: Optional[int]) -> int:
    """Bytes the server has written to this file so far, those dropped included (a mark for `since`)."""
    return figures(path, head_bytes, None)["written"] or 0


def since(path: Any, head_bytes: Optional[int], mark: int, limit: int = 4 << 20) -> tuple[str, bool]:
    """What the server wrote after mark (`written` then), at most limit bytes of it, and whether all of
    it is still there (False: the stretch crosses the marker, whose line stands for what was dropped)."""
    try:
        with open(path, "rb") as f:
            _, at, length, dropped = _layout(f, head_bytes)
            if mark <= at:
                start, whole = mark, not length
            else:
                start = mark - dropped + length
                whole = start >= at + length
                start = max(start, at)
            f.seek(start)
            return f.read(limit).decode("utf-8", "replace"), whole
    except OSError:
        return "", True


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
