"""The README stays a front door (short, with the details one link away in docs/), and every
relative link of the README and the docs reaches a file that exists and, where it names a
section, a heading of that file: moving a section or a file breaks this test, not a reader's
click."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^()\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """The text outside fenced code blocks: a `# comment` in a bash block is no heading."""
    return FENCE.sub("", text)


def anchors(page: Path) -> set[str]:
    """The section ids GitHub gives the page's headings: lower case, punctuation dropped,
    spaces to hyphens, a repeated id numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(prose(page.read_text())):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def relative_links(page: Path) -> list[str]:
    text = CODE_SPAN.sub("", prose(page.read_text()))
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z+.-]*:", t)]


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    return broken


def test_the_readme_is_at_most_200_lines():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (budget {README_MAX_LINES}): move details and measured tables "
        "to docs/ and link them")


def test_every_relative_link_in_the_readme_and_docs_resolves():
    broken = {p.relative_to(ROOT).as_posix(): b for p in PAGES if (b := broken_links(p))}
    assert not broken, broken


def test_the_link_check_finds_a_missing_file_and_a_missing_section(tmp_path):
    (tmp_path / "other.md").write_text("# Title\n\n## A section: `code` (x.py)\n\n```bash\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-section-code-xpy) [top](#here) [web](https://example.com/x)\n"
                    "`[in code](gone.md)` [gone](gone.md) [no section](other.md#not-a-heading)\n\n# Here\n")
    broken = broken_links(page)
    assert [b.split(":")[0] for b in broken] == ["gone.md", "other.md#not-a-heading"], broken
