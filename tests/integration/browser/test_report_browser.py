"""The HTML report as a reader sees it, in headless Chromium: a sweep of two KV dtypes built from a fixture
result (no server), its verdict on the first screen above the charts and the same as the sweep's JSON,
every chart drawn and visible, every contents link landing on its section, and a full-page screenshot
that is not blank. Skipped where Chromium or Playwright is not installed."""

from __future__ import annotations

import copy
import io
import json
import os
import re
import shutil
from pathlib import Path

import pytest
from conftest import FIXTURES
from PIL import Image

from kvexp.report.summary import write_sweep_outputs

try:
    from playwright import sync_api
except ImportError:  # skipped below (failed in CI, which must install it)
    sync_api = None

CHROMIUM = "/usr/bin/chromium"
# Headless as root on a closed network: no sandbox, no GPU, and none of the background connections
# (updates, sync, QUIC) that the network would refuse. Playwright adds --headless and a fresh, empty
# --user-data-dir of its own for every launch.
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
LAUNCH_TIMEOUT_MS = 60_000
VIEWPORT = {"width": 1280, "height": 900}
FIXTURE_RESULT = FIXTURES / "foreign" / "kvexp" / "result.json"
# (KV asked, as the server names it, bytes per element, throughput factor, mean KLD from fp16)
KV_DTYPES = (("fp16", "auto", 2.0, 1.0, 0.0), ("fp8", "fp8", 1.0, 1.3, 0.004))
# The charts two KV dtypes with a quality measurement must produce.
REQUIRED_CHARTS = {"smoke-pareto-ttft", "smoke-pareto-tpot", "quality-memory"}

MISSING = (f"{CHROMIUM} is not installed (apt-get install chromium)" if shutil.which(CHROMIUM) is None else
           "playwright is not installed (pip install -e '.[test]')" if sync_api is None else None)
if MISSING and os.environ.get("CI"):
    pytest.fail(f"{MISSING}: .ci/run must install it", pytrace=False)
pytestmark = [pytest.mark.skipif(MISSING is not None, reason=str(MISSING)), pytest.mark.timeout(300)]


def _depth(context: int, kld: float) -> dict:
    return {"context": context, "status": "ok", "reason": None, "kld_mean": kld, "top1_agreement": 1 - 5 * kld,
            "ppl_base": 12.0, "ppl": 12.0 * (1 + kld)}


def build_sweep(folder: Path) -> Path:
    """A sweep folder of one job per KV dtype (the fixture result, relabelled, with a quality measurement),
    written out by kvexp as at the end of a sweep: sweep.json, summary.md and report/."""
    src = json.loads(FIXTURE_RESULT.read_text(encoding="utf-8"))
    for i, (kv, backend_dtype, bytes_per_element, factor, kld) in enumerate(KV_DTYPES):
        r = copy.deepcopy(src)
        r["label"] = f"vllm-tiny-{kv}-smoke"
        r["kv"] = {"requested": kv, "backend_dtype": backend_dtype, "bytes_per_element": bytes_per_element}
        r["kv_cache"].update(dtype=backend_dtype, dtype_k=backend_dtype, dtype_v=backend_dtype,
                             bytes=int(src["kv_cache"]["bytes"] * bytes_per_element / 2))
        for lv in r["levels"]:
            lv["throughput_tok_s"] = round(lv["throughput_tok_s"] * factor, 2)
        r["quality"] = {
            "kv": kv, "backend_dtype": backend_dtype,
            "baseline": {"kv": "fp16", "backend_dtype": "auto", "key": "fixture", "cached": False},
            "text": {"source": "fixture", "sha256": "0" * 64},
            "teacher_forced": {"method": "prompt_logprobs", "depths": [_depth(64, kld), _depth(128, 1.5 * kld)],
                               "reason": None},
            "continuation": None, "determinism": None, "warnings": []}
        job = folder / f"{i}_{r['label']}"
        job.mkdir(parents=True)
        (job / "result.json").write_text(json.dumps(r), encoding="utf-8")
    write_sweep_outputs(folder)
    return folder


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sweep(tmp_path_factory.mktemp("browser-sweep"))


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, timeout=LAUNCH_TIMEOUT_MS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def report(browser, sweep: Path):
    """The sweep's report.html opened from file:// in a 1280x900 window; `problems` collects every
    request that failed and every console error or uncaught exception of the page."""
    page = browser.new_page(viewport=VIEWPORT)
    problems: list[str] = []
    page.on("requestfailed", lambda req: problems.append(f"request failed: {req.url} ({req.failure})"))
    page.on("console", lambda msg: problems.append(f"console {msg.type}: {msg.text}")
            if msg.type in ("error", "warning") else None)
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.goto((sweep / "report" / "report.html").as_uri(), wait_until="load")
    try:
        yield page, problems
    finally:
        page.close()


def _box(page, selector: str) -> dict:
    """The first match's box in the viewport (CSS pixels: top, bottom, left, right, width, height)."""
    return page.evaluate("s => { const b = document.querySelector(s).getBoundingClientRect(); return {top: b.top, "
                         "bottom: b.bottom, left: b.left, right: b.right, width: b.width, height: b.height}; }",
                         selector)


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def test_the_verdict_is_on_the_first_screen_above_the_charts_and_is_the_one_kvexp_computed(report, sweep):
    page, _ = report
    assert page.evaluate("window.scrollY") == 0
    sections = page.eval_on_selector_all("body > section", "ss => ss.map(s => s.id)")
    assert sections and sections[0] == "verdict", sections
    verdict = page.locator("#verdict ul.verdict")
    assert verdict.is_visible()
    box, chart = _box(page, "#verdict ul.verdict"), _box(page, "figure.chart")
    assert 0 <= box["top"] and box["bottom"] <= VIEWPORT["height"], f"verdict at {box}: below the first screen"
    assert 0 <= box["left"] and box["right"] <= VIEWPORT["width"], f"verdict at {box}: wider than the window"
    assert box["bottom"] <= chart["top"], f"verdict {box} is not above the first chart {chart}"

    expected = json.loads((sweep / "sweep.json").read_text(encoding="utf-8"))["verdicts"]
    assert expected and all(v["choice"] for v in expected), expected
    items = verdict.locator("li")
    assert items.count() == len(expected)
    for i, v in enumerate(expected):
        assert items.nth(i).is_visible()
        assert _flat(items.nth(i).inner_text()) == _flat(f"{v['why']} {v['caveat'] or ''}")
    summary = (sweep / "summary.md").read_text(encoding="utf-8").split("## Verdict", 1)[1].split("\n## ", 1)[0]
    for v in expected:
        assert _flat(v["why"]) in _flat(summary.replace("\\", ""))


def test_every_chart_is_drawn_visible_and_loaded(report, sweep):
    page, problems = report
    figures = page.locator("figure.chart")
    names = [i.removeprefix("chart-") for i in page.eval_on_selector_all("figure.chart", "fs => fs.map(f => f.id)")]
    # the HTML shows every chart the report drew (the Markdown's PNGs, but for the shared legend strips)
    drawn = {p.stem for p in (sweep / "report" / "charts").glob("*.png") if not p.stem.endswith("legend")}
    assert REQUIRED_CHARTS <= set(names), names
    assert set(names) == drawn and len(names) == len(drawn), (names, sorted(drawn))

    images = page.evaluate("() => [...document.images].map(i => ({src: i.src.slice(0, 80), complete: i.complete, "
                           "w: i.naturalWidth, h: i.naturalHeight}))")
    assert all(i["complete"] and i["w"] > 0 and i["h"] > 0 for i in images), images
    for name, fig in zip(names, figures.all()):
        fig.scroll_into_view_if_needed()
        assert fig.is_visible(), name
        graphic = fig.locator("svg, img").first
        assert graphic.count() == 1 and graphic.is_visible(), f"{name}: no visible <svg> or <img>"
        if graphic.evaluate("e => e.tagName.toLowerCase()") == "img":
            assert graphic.evaluate("e => e.complete && e.naturalWidth > 0"), f"{name}: image did not load"
        box = graphic.bounding_box()
        assert box and box["width"] >= 200 and box["height"] >= 120, f"{name}: drawn at {box}"
        # painted: axes and text in grey, and the data in the runs' colours
        pixels = Image.open(io.BytesIO(graphic.screenshot())).convert("RGB")
        counts = pixels.getcolors(pixels.width * pixels.height)
        inked = sum(n for n, rgb in counts if min(rgb) < 200)
        coloured = sum(n for n, (r, g, b) in counts if max(r, g, b) - min(r, g, b) > 60)
        total = pixels.width * pixels.height
        assert inked > total * 0.01, f"{name}: {inked} of {total} pixels inked"
        assert coloured > 100, f"{name}: {coloured} pixels in a run's colour"
    assert problems == []


def test_contents_links_land_on_their_sections(report):
    page, _ = report
    targets = page.eval_on_selector_all("nav.toc a", "as => as.map(a => a.getAttribute('href'))")
    sections = page.eval_on_selector_all("body > section", "ss => ss.map(s => '#' + s.id)")
    assert targets == sections, "the contents list every section, in order"
    inpage = page.eval_on_selector_all("a[href^='#']", "as => as.map(a => a.getAttribute('href'))")
    missing = [h for h in inpage if not page.evaluate("id => document.getElementById(id) !== null", h[1:])]
    assert missing == [], f"links to no anchor: {missing}"
    for i, href in enumerate(targets):
        page.locator("nav.toc a").nth(i).click()
        page.wait_for_function("h => location.hash === h", arg=href)
        box = _box(page, href)
        assert box["height"] > 0 and -1 <= box["top"] < VIEWPORT["height"], f"{href}: section at {box}"


def test_a_full_page_screenshot_is_not_blank(report, tmp_path):
    page, _ = report
    verdict = _box(page, "#verdict ul.verdict")
    height = page.evaluate("document.documentElement.scrollHeight")
    path = tmp_path / "report.png"
    page.screenshot(path=str(path), full_page=True)
    with Image.open(path) as shot:
        assert shot.format == "PNG"
        assert shot.width == VIEWPORT["width"] and shot.height >= max(height, VIEWPORT["height"]) - 1
        rgb = shot.convert("RGB")
    total = rgb.width * rgb.height
    counts = rgb.getcolors(total)
    assert len(counts) > 100, f"{len(counts)} colours: a blank page"
    assert sum(n for n, c in counts if min(c) < 200) > total * 0.005
    # the verdict's own area holds text, not a blank box
    area = rgb.crop((int(verdict["left"]), int(verdict["top"]), int(verdict["right"]), int(verdict["bottom"])))
    dark = sum(n for n, c in area.getcolors(area.width * area.height) if max(c) < 120)
    assert dark > 200, f"{dark} dark pixels in the verdict's area"
