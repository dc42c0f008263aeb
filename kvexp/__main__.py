import sys

if __name__ == "__main__":  # a spawned worker process imports this module too
    try:
        from kvexp.app.cli import entry
    except KeyboardInterrupt:  # Ctrl-C while kvexp is still loading: one line, like anywhere else
        print("kvexp: interrupted by SIGINT", file=sys.stderr)
        sys.exit(130)
    entry()
