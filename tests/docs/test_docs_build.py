"""The documentation site: it builds with warnings as errors (what ``.ci/docs`` runs), its internal links and
anchors resolve, it shows no raw Markdown and no missing image, the API reference holds every name of Bagua's
API reference (seed 004) that ``bagua_lightning.torch_api`` provides, and every example marked runnable runs
on CPU. The site is built once for the module."""

from __future__ import annotations

import html.parser
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from tests.procs import stop_process
from tests.ranks import job_env, run_ranks

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# shared/ lies beside the checkout (the project's seeds: the public documents it was built from).
SEED_004 = sorted((ROOT.parent / "shared" / "seeds").glob("004_*.txt"))
BUILD_TIMEOUT_S = 600
EXAMPLE_TIMEOUT_S = 240

# The first test builds the site (about 30 s of CPU; minutes of wall time on a busy 2-core machine).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built from docs/ as ``.ci/docs`` builds it (-W --keep-going): its html folder."""
    out = tmp_path_factory.mktemp("docs")
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-j", "auto", "-q",
           "-d", str(out / "doctrees"), str(DOCS), str(out / "html")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=BUILD_TIMEOUT_S)
    finally:
        stop_process(proc)
    assert proc.returncode == 0, f"the docs build failed (warnings are errors):\n{output[-8000:]}"
    return out / "html"


def test_ci_docs_runs_the_same_build() -> None:
    script = (ROOT / ".ci" / "docs").read_text()
    assert "-W --keep-going" in script and "docs " in script


# -- pages: links, anchors, images, no raw Markdown ---------------------------------------------------------


class _Page(html.parser.HTMLParser):
    """Ids, links and images of one built page, and its text outside code."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.images: list[str] = []
        self.text: list[str] = []
        self._code = 0
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if values.get("id"):
            self.ids.add(str(values["id"]))
        if tag == "a" and values.get("href"):
            self.links.append(str(values["href"]))
        if tag == "img" and values.get("src"):
            self.images.append(str(values["src"]))
        if tag in ("pre", "code", "tt", "kbd", "samp"):
            self._code += 1
        if tag in ("script", "style"):
            self._skip += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in ("pre", "code", "tt", "kbd", "samp"):
            self._code -= 1
        if tag in ("script", "style"):
            self._skip -= 1

    def handle_data(self, data: str) -> None:
        if not self._code and not self._skip:
            self.text.append(data)


def _pages(site: Path) -> dict[Path, _Page]:
    pages = {}
    for path in sorted(site.rglob("*.html")):
        if path.relative_to(site).parts[0] in ("_static", "_sources", "_modules"):
            continue
        page = _Page()
        page.feed(path.read_text(encoding="utf-8"))
        pages[path] = page
    return pages


def test_internal_links_and_anchors_resolve(site: Path) -> None:
    pages = _pages(site)
    assert len(pages) > 25  # the walk found the site
    broken = []
    for path, page in pages.items():
        for href in page.links:
            parts = urlsplit(href)
            if parts.scheme or parts.netloc or href.startswith("mailto:"):
                continue
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                broken.append(f"{path.relative_to(site)}: {href} (no such page)")
            elif parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else _pages_ids(target)
                if unquote(parts.fragment) not in ids:
                    broken.append(f"{path.relative_to(site)}: {href} (no anchor {parts.fragment!r})")
    assert not broken, "broken internal links:\n" + "\n".join(broken)


def test_the_readmes_links_resolve(site: Path) -> None:
    """README.md links into docs/ as GitHub shows it; each target exists, and each anchor is on the built page."""
    broken = []
    for href in re.findall(r"\]\(([^)\s]+)\)", (ROOT / "README.md").read_text(encoding="utf-8")):
        parts = urlsplit(href)
        if parts.scheme or parts.netloc:
            continue
        target = ROOT / unquote(parts.path) if parts.path else ROOT / "README.md"
        if not target.exists():
            broken.append(f"{href} (no such file)")
        elif parts.fragment:
            built = site / target.relative_to(DOCS).with_suffix(".html") if target.is_relative_to(DOCS) else None
            if built is None or unquote(parts.fragment) not in _pages_ids(built):
                broken.append(f"{href} (no anchor {parts.fragment!r})")
    assert not broken, "broken links in README.md:\n" + "\n".join(broken)


def _pages_ids(path: Path) -> set[str]:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page.ids


def test_every_image_is_there(site: Path) -> None:
    missing = [f"{path.relative_to(site)}: {src}" for path, page in _pages(site).items() for src in page.images
               if not urlsplit(src).scheme and not (path.parent / unquote(urlsplit(src).path)).is_file()]
    assert not missing, f"missing images: {missing}"
    front = _pages(site)[site / "index.html"]
    assert any(src.endswith("architecture.png") for src in front.images)


# Markdown that reached a page as text: a fence, a link or an image in Markdown syntax, a heading's hashes.
_RAW_MARKDOWN = re.compile(r"```|\]\([^)\s]+\)|!\[|^\s*#{1,6} \S", re.M)


def test_no_raw_markdown_on_any_page(site: Path) -> None:
    raw = []
    for path, page in _pages(site).items():
        for match in _RAW_MARKDOWN.finditer("".join(page.text)):
            raw.append(f"{path.relative_to(site)}: {match.group(0)!r}")
    assert not raw, "Markdown shown as text (not rendered):\n" + "\n".join(raw[:40])


# -- the API reference holds Bagua's names ------------------------------------------------------------------


def _seed_names(text: str) -> set[str]:
    """Every object Bagua's reference describes (``bagua.torch_api....``), methods as ``Class.method``."""
    names: set[str] = set()
    current_class = None
    for line in text.splitlines():
        for match in re.finditer(r"(?:^|- )(class )?(bagua\.torch_api(?:\.\w+)*)(?=\(|¶)", line):
            names.add(match.group(2))
            current_class = match.group(2) if match.group(1) else current_class
        method = re.search(r"(?:^|\.)- (\w+)\(self", line)
        if method and current_class and not method.group(1).startswith("_"):
            names.add(f"{current_class}.{method.group(1)}")
    return names


def _provided(name: str) -> bool:
    """Whether ``bagua_lightning.torch_api`` has the object Bagua's ``name`` names."""
    import importlib

    parts = ["bagua_lightning", *name.split(".")[1:]]
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for attr in parts[split:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def _inventory(site: Path) -> set[str]:
    from sphinx.util.inventory import InventoryFile

    with open(site / "objects.inv", "rb") as fh:
        inventory = InventoryFile.load(fh, "", lambda base, uri: uri)
    return {name for kind, objects in inventory.items() if kind.startswith("py:") for name in objects}


@pytest.mark.skipif(not SEED_004, reason="shared/seeds/004_*.txt (Bagua's API reference) is not beside the checkout")
def test_every_bagua_name_that_torch_api_provides_is_in_the_api_reference(site: Path) -> None:
    seed = _seed_names(SEED_004[0].read_text(encoding="utf-8"))
    assert len(seed) > 150, "the seed's names were not found: has its format changed?"
    import bagua_lightning.torch_api  # noqa: F401  (patches torch as Bagua did; the names resolve after it)

    provided = sorted(name for name in seed if _provided(name))
    assert len(provided) > 0.8 * len(seed), f"torch_api provides only {len(provided)} of {len(seed)} names"
    documented = _inventory(site)
    missing = [name for name in provided if "bagua_lightning" + name[len("bagua"):] not in documented]
    assert not missing, f"Bagua's names that torch_api provides but the API reference lacks: {missing}"


# -- runnable examples --------------------------------------------------------------------------------------


def _runnable(site: Path) -> list[dict[str, object]]:
    return json.loads((site / "runnable.json").read_text())


def _python_blocks(markdown: str) -> list[str]:
    return [textwrap.dedent(m.group(1)) for m in re.finditer(r"^```python\n(.*?)^```", markdown, re.M | re.S)]


def test_the_readmes_examples_are_runnable_examples_of_the_site(site: Path) -> None:
    examples = {str(entry["code"]).strip() for entry in _runnable(site)}
    blocks = _python_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(blocks) >= 2
    stale = [block for block in blocks if block.strip() not in examples]
    assert not stale, "README.md's Python examples must be runnable blocks of the docs (getting_started.md):\n" + (
        "\n---\n".join(stale))


def test_every_runnable_example_runs_on_cpu(site: Path, tmp_path: Path) -> None:
    examples = _runnable(site)
    assert len(examples) >= 2
    failures = []
    for index, entry in enumerate(examples):
        folder = tmp_path / f"example{index}"
        folder.mkdir()
        script = folder / "example.py"
        script.write_text(str(entry["code"]))
        where = f"docs/{entry['docname']} line {entry['line']}"
        ranks = int(str(entry["ranks"]))
        if ranks > 1:
            try:
                run_ranks(str(script), [], world_size=ranks, log_dir=folder, hide_cuda=True,
                          env={"GLOO_SOCKET_IFNAME": "lo"}, timeout_s=EXAMPLE_TIMEOUT_S)
            except (AssertionError, TimeoutError) as exc:
                failures.append(f"{where} ({ranks} ranks): {exc}")
            continue
        env = job_env({"CUDA_VISIBLE_DEVICES": "", "GLOO_SOCKET_IFNAME": "lo"})
        log = folder / "log.txt"
        with open(log, "wb") as fh:
            proc = subprocess.Popen([sys.executable, str(script)], cwd=folder, env=env, stdout=fh,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = proc.wait(timeout=EXAMPLE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                stop_process(proc)
        if code != 0:
            failures.append(f"{where}: exit {code}\n{log.read_text(errors='replace')[-3000:]}")
    assert not failures, "\n\n".join(failures)


# -- in a browser -------------------------------------------------------------------------------------------


@pytest.mark.skipif(not (shutil.which("chromium") or shutil.which("chromium-browser")),
                    reason="no chromium (apt-get install -y chromium): the screenshots are not taken")
def test_screenshots_of_the_front_page_and_an_api_page(site: Path, tmp_path: Path) -> None:
    proc = subprocess.run([str(DOCS / "_tools" / "screenshot.sh"), str(site), str(tmp_path)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    shots = [Path(line) for line in proc.stdout.split()]
    assert {p.name for p in shots} >= {"index.png", "api_strategy.png"}
    import matplotlib.image

    for shot in shots:
        pixels = matplotlib.image.imread(shot)
        assert pixels.shape[0] >= 900 and pixels.shape[1] >= 1200, (shot, pixels.shape)
        # A rendered page: text and images on a light background, not one flat colour (a blank or error page).
        assert pixels.std() > 0.05, f"{shot} is nearly one colour"


# -- benchmark plots ----------------------------------------------------------------------------------------


def test_ratios_are_found_with_their_intervals_in_a_benchmarks_json() -> None:
    from benchmarks.plots import Ratio, ratios

    document = {"baseline": "ddp", "args": {"rounds": 8},
                "results": {"ddp": {"ratio": 1.0, "ci95": [1.0, 1.0], "median_ms": 9.0},
                            "bytegrad": {"ratio": 2.5, "ci95": [2.4, 2.6], "median_ms": 3.6}},
                "auto": {"auto": {"chosen": "bytegrad", "vs_chosen": {"variant": "bytegrad", "ratio": 0.99,
                                                                     "ci95": [0.97, 1.01]}}},
                "autotuned_vs_ddp": 1.08, "autotuned_vs_ddp_ci95": [1.05, 1.1], "steps": 3}
    assert list(ratios(document)) == [
        Ratio("ddp", 1.0, 1.0, 1.0), Ratio("bytegrad", 2.5, 2.4, 2.6),
        Ratio("auto auto vs_chosen (vs bytegrad)", 0.99, 0.97, 1.01), Ratio("autotuned_vs_ddp", 1.08, 1.05, 1.1)]


def test_every_benchmark_result_is_plotted_and_the_plots_redraw(site: Path, tmp_path: Path) -> None:
    from benchmarks.plots import DEFAULT_OUT, load_manifest

    results = load_manifest()
    assert results, "docs/benchmarks/results/manifest.json lists no result"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.plots", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    drawn = {Path(line).name for line in proc.stdout.split()}
    assert drawn == {f"{r.stem}.png" for r in results}
    assert all((DEFAULT_OUT / name).is_file() for name in drawn), "commit the plots: python -m benchmarks.plots"
    page = _pages(site)[site / "benchmark_summary.html"]
    assert {Path(src).name for src in page.images} >= drawn
