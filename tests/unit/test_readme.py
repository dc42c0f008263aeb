"""The README as a newcomer reads it: every `python -m kvexp` command in its code blocks (and in the docs') parses (a run's
overrides compose and pass the configuration checks; a subcommand's parser accepts its arguments; plan
runs, as nothing is launched), its first screen starts on the user's GPU, and --help names what the
code takes. Nothing is launched, built or downloaded."""

from __future__ import annotations

import re
import shlex

import pytest
from conftest import ROOT

from kvexp.app import cli, installer
from kvexp.core.config import ConfigError
from kvexp.workload.files import DataError
from kvexp.app.compose import (backend_only_keys, check, compose_all, hydra_argv, kv_choices, refuse_repeats,
                               refuse_unread)

README = (ROOT / "README.md").read_text(encoding="utf-8")
FIRST_SCREEN = "\n".join(README.splitlines()[:60])


def commands(text: str) -> list[list[str]]:
    """The arguments of every `python -m kvexp ...` in the text's fenced code blocks (continued lines
    joined, `&&` chains split, comments dropped)."""
    out = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                if not re.match(r"\s*([A-Z_]+=\S*\s+)*python -m kvexp", part):  # output, or another tool's command
                    continue
                words = shlex.split(part, comments=True)
                while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # KVEXP_CALIBRATION=... python -m kvexp
                    words = words[1:]
                if words[:3] == ["python", "-m", "kvexp"]:
                    out.append(words[3:])
    return out


# the README's commands, then every doc's: each runs as printed
COMMANDS = commands(README) + [c for p in sorted((ROOT / "docs").glob("*.md"))
                               for c in commands(p.read_text(encoding="utf-8"))]


USER_FILES = ("scenario.dataset", "scenario.trace", "quality.text", "model.gguf", "model.hf")  # the user's files


class _Parsed(Exception):
    """A subcommand's parser accepted its arguments: stop before the command runs."""


def test_the_readme_has_commands_to_check():
    assert len(COMMANDS) >= 20
    assert [] in COMMANDS  # `python -m kvexp`, the CPU demo


def _parse_only(monkeypatch):
    for parser in (cli._Parser, installer._Parser):
        original = parser.parse_args

        def parse(self, *a, _original=original, **kw):
            _original(self, *a, **kw)
            raise _Parsed

        monkeypatch.setattr(parser, "parse_args", parse)


@pytest.mark.parametrize("args", COMMANDS, ids=[" ".join(a)[:80] or "(run)" for a in COMMANDS])
def test_every_readme_command_parses(args, monkeypatch, capsys):
    if args and args[0] in cli.SUBCOMMANDS and args[0] != "plan":
        _parse_only(monkeypatch)
        with pytest.raises(_Parsed):
            cli.SUBCOMMANDS[args[0]](args[1:])
        return
    if args[:1] == ["plan"] or args in (["--help"], ["--version"]):
        assert cli.main(args) == 0, capsys.readouterr().err
        return
    argv = hydra_argv(args)  # a run: composed and checked as run_experiment does, nothing launched
    multirun = "-m" in argv
    given = [a for a in argv if not a.startswith("-")]
    try:
        overrides, _ = backend_only_keys(given)
        refuse_repeats(overrides)
        jobs = compose_all(overrides)
        refuse_unread(overrides, jobs)
        kvs = kv_choices()
        reasons = [check(cfg, kvs, multirun) for _, cfg in jobs]
    except (ConfigError, DataError) as e:
        # a doc's example of the user's own file (scenario.dataset=/data/sharegpt.jsonl): everything else
        # was accepted, and the one refusal names that file as missing
        files = [a.split("=", 1)[1] for a in given if "=" in a and a.split("=", 1)[0] in USER_FILES]
        assert files and any(f in str(e) for f in files) and "no such file" in str(e).lower(), e
        return
    assert any(r is None for r in reasons), reasons  # a skipped pair is fine, a run of nothing is not


def test_the_first_screen_starts_on_the_users_gpu():
    assert "## Quick start on your GPU" in FIRST_SCREEN
    for needed in ("backend.endpoint=", "backend.binary=", "backend.python=", "backend.n_gpu_layers=",
                   "scenario.slo_ttft_ms=", "scenario.slo_tpot_ms=", "scenario.search=concurrency", "Prerequisites",
                   "Python 3.11", "cmake", "Go 1.26", "Pango"):
        assert needed in FIRST_SCREEN, needed
    first = commands(FIRST_SCREEN)
    assert any("backend.endpoint=" in " ".join(c) for c in first)
    # the GPU comes before the CPU demo
    assert FIRST_SCREEN.index("## Quick start on your GPU") < README.index("## The CPU demo")


def test_the_set_up_commands_stay_and_the_test_set_up_says_what_it_is():
    assert "pip install -e . && python -m kvexp install && python -m kvexp\n" in README
    assert "bash .ci/run\n" in README
    before = README[:README.index("```\nbash .ci/run")].rstrip("\n")
    paragraph = before[before.rindex("\n\n"):]
    for word in ("test", "root", "apt", "Slurm", "MariaDB", "Chromium"):
        assert word in paragraph, word


def test_help_names_what_install_takes(capsys):
    assert cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    assert f"install [{'|'.join(installer.choices())}] [--force] [--cpu|--cuda]" in text
    assert {"llamacpp", "vllm", "ollama", "smollm2", "gemma3"} <= set(installer.choices())
    assert "backend.n_gpu_layers" in text and "backend.tensor_parallel" in text and "model.allow_download" in text
