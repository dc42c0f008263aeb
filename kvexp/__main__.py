import signal
import sys


def _loading(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


if __name__ == "__main__":  # a spawned worker process imports this module too
    # a signal while kvexp is still loading ends it in one line, like anywhere else (each command puts
    # its own handlers in place of these)
    for _sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(_sig, _loading)
    try:
        from kvexp.app.cli import entry
    except KeyboardInterrupt as e:
        name = str(e) or "SIGINT"
        print(f"kvexp: interrupted by {name}", file=sys.stderr)
        sys.exit(128 + signal.Signals[name])
    entry()
