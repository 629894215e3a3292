"""The README, docs/ and the code name only files that are in the repository: every relative markdown link
resolves, every `path/like/this.py` a doc quotes exists, and every .md file a code comment or docstring names
exists (a page cited from the code that nobody can open is a broken promise)."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TOP = ("bench", "bin", "configs", "docs", "envs", "examples", "flows", "methods", "models", "stores", "tasks",
       "tests", ".ci")
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
         *sorted((REPO / "bench" / "results").glob("*/README.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
QUOTED = re.compile(r"`([\w.-]+(?:/[\w.<>{}*-]+)+)`")
# a page of the repository: docs/x.md, a folder's README.md, or a bare upper-case page name (a lower-case
# bare name, e.g. report.md, is a file a run writes)
MD_IN_CODE = re.compile(r"(?<![\w/.-])((?:[\w-]+/)+[\w-]+\.md|[A-Z][A-Z_-]*\.md)\b")


def _exists(ref: str, base: Path) -> bool:
    return any((root / ref).exists() for root in (base, REPO))


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_a_page_links_and_quotes_only_files_that_exist(page):
    text = page.read_text()
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#")[0]
        if path and not _exists(path, page.parent):
            broken.append(f"link ({target})")
    for quoted in QUOTED.findall(text):
        path = quoted.split(":")[0].rstrip(".,")
        if path.split("/")[0] not in TOP or re.search(r"[<>{}*]", path):
            continue   # a command, a pattern or a path under a run's own folder, not a file of the repository
        if not any(_exists(p, page.parent) for p in (path, path.rstrip("/"), path + ".py")):   # bench/compare: a module
            broken.append(f"`{quoted}`")
    assert not broken, f"{page.relative_to(REPO)} names files that are not in the repository: {broken}"


def test_code_cites_only_pages_that_exist():
    broken = []
    for folder in TOP:
        for path in sorted((REPO / folder).rglob("*.py")) if (REPO / folder).is_dir() else []:
            if path == Path(__file__).resolve():
                continue   # its own examples
            for ref in MD_IN_CODE.findall(path.read_text()):
                if not _exists(ref, path.parent):
                    broken.append(f"{path.relative_to(REPO)}: {ref}")
    assert not broken, f"code cites pages that are not in the repository: {broken}"
