"""The documentation site builds with `mkdocs build --strict`, and no link of the site or of the
README points at nothing: a missing page, a missing file or a missing anchor."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import unicodedata
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

try:
    import mkdocs  # noqa: F401
except ImportError:
    if os.environ.get("CI"):  # CI installs the dev extra, which holds docs: a skip would hide it
        raise
    pytest.skip(
        "the docs extra is not installed: pip install -e '.[docs]'", allow_module_level=True
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once for the module's tests, strict: any warning (a broken link or
    anchor, a page left out of the nav) fails the build."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def test_site_builds_strict_with_every_page_in_its_nav(site: Path) -> None:
    pages = sorted(p.relative_to(DOCS).with_suffix("") for p in DOCS.glob("*.md"))
    assert pages, "no pages in docs/"
    for page in pages:
        html = site / ("index.html" if page.name == "index" else f"{page}/index.html")
        assert html.is_file(), f"docs/{page}.md has no page in the site"


def test_the_sites_home_page_carries_the_readmes_sections(site: Path) -> None:
    """docs/index.md includes the README's start, install, tour and stopping sections, so the
    two say the same; a section marker renamed or removed fails the build (check_paths)."""
    page = re.sub(r"<[^>]+>", "", (site / "index.html").read_text(encoding="utf-8"))
    for words in (
        "bash scripts/test.sh",
        "pip install -e",
        "gpupool up --fake 4xH100-80GB --background",
        "gpupool down stops a pool started with --background",
    ):
        assert words in page, f"the site's home page lacks the README's {words!r}"


class _Links(HTMLParser):
    """Collects every id and every href/src of one HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name in ("id", "name"):
                self.ids.add(value)
            elif name in ("href", "src") and tag in ("a", "img"):
                self.links.append(value)


def _parse(html: Path) -> _Links:
    parser = _Links()
    parser.feed(html.read_text(encoding="utf-8"))
    return parser


def test_every_link_of_the_built_site_reaches_a_page_and_its_anchor(site: Path) -> None:
    pages = {p: _parse(p) for p in site.rglob("*.html")}
    broken: list[str] = []
    for page, parsed in pages.items():
        for link in parsed.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith(("mailto:", "javascript:")):
                continue  # outside the site: not ours to check offline
            path = unquote(parts.path)
            # 404.html links from the site's root (it is served for any missing path)
            base = site if path.startswith("/") else page.parent
            target = (base / path.lstrip("/")).resolve() if path else page
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{page.relative_to(site)}: {link} (no such file)")
                continue
            if parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else _parse(target).ids
                if unquote(parts.fragment) not in ids:
                    broken.append(f"{page.relative_to(site)}: {link} (no such anchor)")
    assert not broken, "broken links in the site:\n" + "\n".join(broken)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped (hyphens
    and underscores kept), spaces as hyphens. MkDocs' default slugs agree on every heading
    these files use, and mkdocs --strict checks the site's own."""
    text = re.sub(r"`([^`]*)`", r"\1", heading).strip().lower()
    text = "".join(ch for ch in text if ch in "-_ " or unicodedata.category(ch)[0] in ("L", "N"))
    return text.replace(" ", "-")


def anchors_of(markdown: Path) -> set[str]:
    """Every heading anchor of a Markdown file, numbered as GitHub numbers repeats."""
    seen: dict[str, int] = {}
    anchors: set[str] = set()
    in_code = False
    for line in markdown.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        match = None if in_code else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = github_slug(match.group(1))
            n = seen.get(slug, 0)
            anchors.add(slug if n == 0 else f"{slug}-{n}")
            seen[slug] = n + 1
    return anchors


def markdown_links(markdown: Path) -> list[str]:
    """Inline links and images outside code blocks and code spans."""
    links: list[str] = []
    in_code = False
    for line in markdown.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        if not in_code:
            prose = re.sub(r"`[^`]*`", "", line)
            links += re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose)
    return links


def test_github_slugs_follow_githubs_rules() -> None:
    assert github_slug("Known limits") == "known-limits"
    assert github_slug("Running programs on leased GPUs: `gpupool run`") == (
        "running-programs-on-leased-gpus-gpupool-run"
    )
    assert github_slug("Measured (a 2-core x86_64 machine, CPython 3.11)") == (
        "measured-a-2-core-x86_64-machine-cpython-311"
    )


def test_every_link_of_the_readme_reaches_a_file_and_its_anchor() -> None:
    links = markdown_links(README)
    assert links, "the README links nothing: the pattern no longer finds its links"
    broken: list[str] = []
    for link in links:
        parts = urlsplit(link)
        if parts.scheme or parts.netloc:
            continue
        target = (ROOT / unquote(parts.path)).resolve() if parts.path else README
        if not target.exists():
            broken.append(f"{link} (no such file)")
        elif (
            parts.fragment
            and target.suffix == ".md"
            and unquote(parts.fragment) not in anchors_of(target)
        ):
            broken.append(f"{link} (no such heading in {target.relative_to(ROOT)})")
    assert not broken, "broken links in README.md:\n" + "\n".join(broken)


def test_the_readme_links_every_page_of_the_docs() -> None:
    linked = {
        (ROOT / urlsplit(link).path).resolve()
        for link in markdown_links(README)
        if not urlsplit(link).scheme
    }
    missing = [
        str(p.relative_to(ROOT))
        for p in sorted(DOCS.glob("*.md"))
        if p.name != "index.md" and p.resolve() not in linked
    ]
    assert not missing, (
        f"the README's page list lacks {missing}: add a row to its table under 'Where the rest "
        "is' (and the page to mkdocs.yml's nav)"
    )


# Project text speaks of the product: not of who measured what in which sitting.
_NOT_PRODUCT_TEXT = re.compile(
    r"\b[Ss]essions? \d+\b|\b[Tt]his session\b|\blast session\b|\b[Rr]uns? [A-Z](?![\w/])"
    r"|\b[Rr]uns [A-Z] and [A-Z]\b|\bdev VM\b|\bVM of the day\b",
)


def test_docs_speak_of_the_product_only() -> None:
    files = [README, *DOCS.glob("*.md"), *(ROOT / "bench" / "results").glob("*.md")]
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in files
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if _NOT_PRODUCT_TEXT.search(line)
    ]
    assert not found, "text about sittings and lettered runs:\n" + "\n".join(found)


def test_readme_stays_a_short_guide() -> None:
    assert README.stat().st_size <= 12 * 1024, "the README is a user guide: 12 KB at most"
