"""A dataset file: JSONL of chat messages ({"messages": [...]}), ShareGPT ({"conversations": [...]})
or plain prompts ({"prompt": "..."}), read into Entry objects (kvexp/workload/files.py reads the lines
and names a bad one)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from kvexp.core.config import MAX_TOKENS
from kvexp.workload.files import check_line, read_jsonl, shipped_or_given, short, type_name
from kvexp.workload.values import is_int


@dataclass(frozen=True)
class Message:
    role: str  # system | user | assistant
    content: str


@dataclass(frozen=True)
class Entry:
    """One dataset line: the conversation up to and including its last user message (what a single
    request sends), the assistant's reply after it if the file has one, the output length the line
    asks for if any, and every user message in order (for multi-turn replay)."""

    line: int
    messages: tuple[Message, ...]
    reply: Optional[str]
    output_tokens: Optional[int]
    user_turns: tuple[str, ...]


CHAT_ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}
_SHAPES = ("messages", "conversations", "prompt")
# A user turn of nothing (or only spaces) sends the chat template alone: a request of a few template
# tokens measured as if it were the dataset's prompt.
EMPTY = "an empty user message: its request would send the chat template alone"


def _turns(value: Any, field: str, role_key: str, text_key: str, roles: dict[str, str]) -> list[Message]:
    check_line(isinstance(value, list), f"{field}: expected a list, got {type_name(value)}")
    out = []
    for i, m in enumerate(value):
        at = f"{field}[{i}]"
        check_line(isinstance(m, dict), f"{at}: expected an object, got {type_name(m)}")
        check_line(role_key in m, f"{at}.{role_key}: missing")
        role = m[role_key]
        check_line(isinstance(role, str) and role in roles,
                   f"{at}.{role_key}: {short(role)} is not one of {', '.join(roles)}")
        check_line(text_key in m, f"{at}.{text_key}: missing")
        check_line(isinstance(m[text_key], str), f"{at}.{text_key}: expected a string, got {type_name(m[text_key])}")
        check_line(roles[role] != "user" or bool(m[text_key].strip()), f"{at}.{text_key}: {EMPTY}")
        out.append(Message(roles[role], m[text_key]))
    return out


def _entry(n: int, obj: Any) -> Entry:
    check_line(isinstance(obj, dict) and any(k in obj for k in _SHAPES),
               'expected an object with "messages", "conversations" or "prompt"')
    given = [k for k in _SHAPES if k in obj]
    check_line(len(given) == 1, f'has both "{given[0]}" and "{given[-1]}": give one')
    if "messages" in obj:
        turns = _turns(obj["messages"], "messages", "role", "content", {r: r for r in CHAT_ROLES})
    elif "conversations" in obj:
        turns = _turns(obj["conversations"], "conversations", "from", "value", SHAREGPT_ROLES)
    else:
        check_line(isinstance(obj["prompt"], str), f"prompt: expected a string, got {type_name(obj['prompt'])}")
        check_line(bool(obj["prompt"].strip()), f"prompt: {EMPTY}")
        turns = [Message("user", obj["prompt"])]
    users = [i for i, m in enumerate(turns) if m.role == "user"]
    check_line(bool(users), "no user message")
    out_tokens = obj.get("output_tokens")
    check_line(out_tokens is None or (is_int(out_tokens) and out_tokens >= 1),
               "output_tokens: must be an integer >= 1")
    check_line(out_tokens is None or out_tokens <= MAX_TOKENS, f"output_tokens: must be <= {MAX_TOKENS:,}")
    last = users[-1]
    reply = next((m.content for m in turns[last + 1:] if m.role == "assistant"), None)
    return Entry(line=n, messages=tuple(turns[: last + 1]), reply=reply, output_tokens=out_tokens,
                 user_turns=tuple(turns[i].content for i in users))


def load_dataset(path: str | Path) -> list[Entry]:
    """Every entry of a JSONL dataset, in file order. Raises DataError naming the file, line and field."""
    return read_jsonl(shipped_or_given(path), _entry)
