"""Write the small example files kvexp ships in kvexp/workload/datasets/ (made-up words, fixed seed).

    python -m kvexp.workload.examples examples [DIR]

writes sharegpt-tiny.jsonl, chat-tiny.jsonl and trace-tiny.jsonl again (into DIR, default the
shipped folder) and checks that they load. kvexp never downloads a dataset."""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path
from typing import Optional

from kvexp.workload.dataset import load_dataset
from kvexp.workload.files import DATASETS_DIR
from kvexp.workload.prompts import made_up_words
from kvexp.workload.trace import load_trace

EXAMPLES_SEED = 1729


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(made_up_words(rng, rng.randint(lo, hi)))


def _example_chat(rng: random.Random) -> list[tuple[str, str]]:
    """(role, text) of one made-up conversation: maybe a system turn, then 1-3 user/assistant exchanges."""
    turns = [("system", _text(rng, 5, 15))] if rng.random() < 0.3 else []
    for _ in range(rng.randint(1, 3)):
        turns += [("user", _text(rng, 5, 60)), ("assistant", _text(rng, 5, 40))]
    return turns


def _example_trace(rng: random.Random, rows: int = 64, rate: float = 8.0, block: int = 16) -> list[dict]:
    groups = [list(range(g * 4, g * 4 + rng.randint(2, 4))) for g in range(4)]  # "system prompt" ids
    fresh, t, out = 1000, 0.0, []
    for i in range(rows):
        if i:
            t += rng.expovariate(rate)
        length = rng.randint(48, 192)
        ids = list(rng.choice(groups)) if rng.random() < 0.5 else []
        ids = ids[: math.ceil(length / block)]
        while len(ids) < math.ceil(length / block):
            ids.append(fresh)
            fresh += 1
        out.append({"timestamp": round(t * 1000), "input_length": length,
                    "output_length": rng.randint(8, 32), "hash_ids": ids})
    return out


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows), encoding="utf-8")
    return path


def write_examples(directory: Path) -> list[Path]:
    """Write sharegpt-tiny.jsonl, chat-tiny.jsonl and trace-tiny.jsonl (made-up words, fixed seed;
    the trace's hash ids are for 16-token blocks) into `directory`, and check that they load."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"examples:{EXAMPLES_SEED}:sharegpt")
    sharegpt_from = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = [{"id": f"tiny-{i:03d}", "conversations": [{"from": sharegpt_from[r], "value": t}
                                                         for r, t in _example_chat(rng)]} for i in range(40)]
    rng = random.Random(f"examples:{EXAMPLES_SEED}:chat")
    chat = [{"messages": [{"role": r, "content": t} for r, t in _example_chat(rng)]} for _ in range(24)]
    trace = _example_trace(random.Random(f"examples:{EXAMPLES_SEED}:trace"))
    paths = [_write_jsonl(directory / "sharegpt-tiny.jsonl", sharegpt),
             _write_jsonl(directory / "chat-tiny.jsonl", chat),
             _write_jsonl(directory / "trace-tiny.jsonl", trace)]
    load_dataset(paths[0])
    load_dataset(paths[1])
    load_trace(paths[2])
    return paths


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvexp.workload.examples", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("examples", help="write the example datasets and trace kvexp ships")
    ex.add_argument("directory", nargs="?", default=str(DATASETS_DIR), help="default: kvexp/workload/datasets/")
    args = ap.parse_args(argv)
    for p in write_examples(Path(args.directory)):
        print(f"{p} ({p.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
