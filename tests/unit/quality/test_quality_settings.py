"""Quality settings and inputs: the quality scenario composes, and every setting or input that cannot give a
figure is refused in one line before anything is made (the measurements on real servers:
tests/integration/test_quality.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY, ROOT

from kvexp.app.compose import compose
from kvexp.app.checks import check_config
from kvexp.core.config import ConfigError


def test_quality_scenario_composes_without_speed_levels():
    cfg = compose(["scenario=quality", "model=tiny-quality"])
    assert cfg.scenario.kind == "quality" and cfg.scenario.concurrency == []
    check_config(cfg)
    assert cfg.quality.depths == [512, 2048, 4096] and cfg.quality.baseline == "fp16"
    assert compose([*TINY, "quality.enabled=true", "quality.prompts=3"]).quality.prompts == 3


@pytest.mark.parametrize("override, expected", [
    ("quality.depths=[8]", "quality.depths=[8]: give context depths of at least 16 tokens"),
    ("quality.prompts=0", "quality.prompts=0: must be >= 1"),
    ("quality.text=/no/such/file.txt", "quality.text=/no/such/file.txt: no such file"),
    ("quality.text=/tmp", "quality.text=/tmp: a folder, not a file"),
    ("quality.text=/dev/null", "quality.text=/dev/null: a device or socket, not a regular file"),
    ("quality.baseline=fp9", "quality.baseline=fp9: no such KV option"),
    ("scenario.kind=fast", "scenario.kind='fast': allowed values are speed, quality"),
])
def test_bad_quality_settings_are_one_line(override, expected):
    with pytest.raises(ConfigError) as e:
        check_config(compose([*TINY, override]))
    assert str(e.value).startswith(expected) and "\n" not in str(e.value)


def _texts(folder: Path) -> dict[str, Path]:
    out = {"latin1": "caf\xe9 au lait, " * 200, "short": "twelve bytes"}
    paths = {k: folder / f"{k}.txt" for k in (*out, "binary")}
    for k, v in out.items():
        paths[k].write_bytes(v.encode("latin-1"))
    paths["binary"].write_bytes(bytes(range(256)) * 40)
    return paths


@pytest.mark.parametrize("case, expected", [
    ("latin1", "quality.text={latin1}: not UTF-8 (byte 0xe9 at offset 3); convert it, e.g. iconv -f latin1 -t utf-8"),
    ("binary", "quality.text={binary}: binary data (a NUL byte at offset 0), not text"),
    ("short", "quality.text={short}: 12 characters, fewer than the 1,024 tokens the shallowest depth (512) needs"),
    ("deep", "quality.depths=[512, 16384]: 16,384 is beyond model=tiny-quality's trained context of 8,192 tokens"),
    ("endpoint", "quality with backend.endpoint=http://127.0.0.1:9: kvexp cannot set an attached server's KV dtype"),
])
def test_quality_inputs_that_cannot_give_a_figure_are_refused_before_anything_is_made(tmp_path, case, expected):
    """A Latin-1 text once gave PPL 3.3e115, a 12-byte one skipped every depth silently, a depth of 1e8
    made llama-perplexity allocate 51 GB, and an attached f16 server's continuations were labelled q8_0.
    Each is refused in one line before the run's folder is made (it used to leave a folder and a failed
    result behind)."""
    paths = _texts(tmp_path)
    extra = {"deep": "quality.depths=[512,16384]", "endpoint": "backend.endpoint=http://127.0.0.1:9"}
    arg = extra.get(case, f"quality.text={paths.get(case)}")
    p = subprocess.run([sys.executable, "-m", "kvexp", "model=tiny-quality", "scenario=quality", arg,
                        f"hydra.run.dir={tmp_path}/run"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 1, p.stderr[-2000:]
    assert p.stderr.startswith("kvexp: " + expected.format(**paths)) and p.stderr.count("\n") == 1, p.stderr
    assert not (tmp_path / "run").exists()
