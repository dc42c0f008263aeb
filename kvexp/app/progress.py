"""Live progress per job and level: requests done, tokens/s, errors, elapsed and remaining time.

An Observer of the load generator (kvexp.measure.client.Observer). request_done runs on the measuring event
loop once per request, so it only adds to three counters; rich draws the display from those counters
on its own timer (a few times a second, in its own thread) and never on the request path. When the
output is not a terminal, the plain observer given (log lines per level) is used instead."""

from __future__ import annotations

import atexit
import time
from typing import TYPE_CHECKING, Any, Optional

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from kvexp.metrics.levels import Level

REFRESH_PER_SECOND = 4


def _duration(s: Optional[float]) -> str:
    if s is None:
        return "?"
    s = max(0.0, s)
    return f"{s:.1f} s" if s < 60 else f"{int(s // 60)} min {int(s % 60):02d} s"


class LiveProgress:
    """A rich display of the level in progress, and one line per finished level."""

    def __init__(self, label: str, console: Optional[Console] = None, repeats: int = 1,
                 refresh_per_second: float = REFRESH_PER_SECOND):
        self.label = label
        self.console = console or Console(stderr=True)
        self.repeats = repeats
        self.refresh_per_second = refresh_per_second
        self.live: Optional[Live] = None
        self._registered = False
        self.level: float = 0
        self.repeat = 0
        self.total = 0
        self.t0 = 0.0
        # the only state request_done touches
        self.done = 0
        self.errors = 0
        self.tokens = 0

    # ---- Observer hooks
    def level_started(self, level: float, total: int, repeat: int) -> None:
        self.close()
        self.level, self.total, self.repeat = level, total, repeat
        self.done = self.errors = self.tokens = 0
        self.t0 = time.perf_counter()
        if not self._registered:  # a level cut short (an error, an interrupt) leaves no display behind
            atexit.register(self.close)
            self._registered = True
        self.live = Live(self, console=self.console, refresh_per_second=self.refresh_per_second,
                         transient=True, redirect_stdout=False, redirect_stderr=False)
        self.live.start()

    def request_done(self, record: Any) -> None:
        self.done += 1
        if record.error_kind is not None:
            self.errors += 1
        elif record.output_tokens:
            self.tokens += record.output_tokens

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None

    def level_done(self, level: float, s: Level) -> None:
        self.close()
        failed = s.status != "ok"
        line = Text.assemble(
            (f"{self.label}", "bold"), f"  {self._level_name()}: ",
            (f"{s.throughput_tok_s} tok/s", "cyan"),
            f", TTFT p50 {s.ttft_p50_ms} ms, TPOT p50 {s.tpot_p50_ms} ms, ",
            (f"errors {s.errors}/{s.requests}", "red" if s.errors else ""),
            (" FAILED", "bold red") if failed else "",
            (" (client-limited)", "yellow") if s.client_limited else "",
        )
        self.console.print(line)

    # ---- drawing (rich calls this on its refresh timer)
    def _level_name(self) -> str:
        name = f"level {self.level:g}"
        if self.repeats > 1 or self.repeat:
            name += f" (repeat {self.repeat + 1}" + (f"/{self.repeats})" if self.repeats > 1 else ")")
        return name

    def snapshot(self) -> dict[str, Any]:
        elapsed = time.perf_counter() - self.t0
        done, total = self.done, self.total
        remaining = elapsed / done * (total - done) if done else None
        return {"done": done, "total": total, "errors": self.errors, "elapsed_s": elapsed,
                "tok_s": self.tokens / elapsed if elapsed > 0 else 0.0, "remaining_s": remaining}

    def __rich__(self) -> Group:
        snap = self.snapshot()
        grid = Table.grid(padding=(0, 1))
        grid.add_row(Text(self.label, style="bold"), Text(self._level_name()),
                     ProgressBar(total=max(1, snap["total"]), completed=snap["done"], width=30),
                     Text(f"{snap['done']}/{snap['total']} requests"),
                     Text(f"{snap['tok_s']:,.0f} tok/s", style="cyan"),
                     Text(f"{snap['errors']} errors", style="red" if snap["errors"] else "dim"),
                     Text(f"elapsed {_duration(snap['elapsed_s'])}"),
                     Text(f"remaining {_duration(snap['remaining_s'])}", style="dim"))
        return Group(grid)


def make_observer(label: str, plain: Any, repeats: int = 1, console: Optional[Console] = None) -> Any:
    """The live display when the output is a terminal, else `plain` (an observer writing log lines)."""
    console = console or Console(stderr=True)
    if not console.is_terminal or console.is_dumb_terminal:
        return plain
    return LiveProgress(label, console, repeats)
