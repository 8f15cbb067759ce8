"""The glossary (docs/design/glossary.md) keeps the project's own words defined: every link on it leads to a
page and heading that exist, every entry links to a guide, and a word it lists as retired never comes back in
the product code, the docs or the README."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GLOSSARY = ROOT / "docs" / "design" / "glossary.md"
SCANNED = ("gateway", "policies", "backends", "tools", "docs", "README.md")
SUFFIXES = {".py", ".md", ".html", ".js", ".css", ".yaml", ".yml", ".toml", ".txt", ".json"}
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """The id Python-Markdown's toc extension gives a heading (its default slugify)."""
    text = re.sub(r"[^\w\s-]", "", heading).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    return {anchor(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", page.read_text(), re.M)}


def entries(text: str) -> dict[str, str]:
    """Each `### Term` heading and the text under it, up to the next heading."""
    parts = re.split(r"^(#{2,3} .+)$", text, flags=re.M)
    return {parts[i][4:].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2) if parts[i].startswith("### ")}


def retired(text: str) -> list[str]:
    """The words in the first column of the Retired words table."""
    section = text.split("## Retired words", 1)[1]
    words: list[str] = []
    for row in re.findall(r"^\|([^|]+)\|[^|]+\|\s*$", section, re.M):
        if set(row.strip()) - set("-") and row.strip() != "retired":
            words += [w.strip() for w in row.split(",") if w.strip()]
    return words


def broken_links(page: Path) -> list[str]:
    bad = []
    for target in LINK.findall(page.read_text()):
        path, _, frag = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.is_file():
            bad.append(f"{target}: no page {dest}")
        elif frag and frag not in anchors(dest):
            bad.append(f"{target}: no heading #{frag} on {dest.name}")
    return bad


def uses(words: list[str]) -> list[str]:
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, words)) + r")\b", re.I)
    found = []
    for top in SCANNED:
        base = ROOT / top
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.suffix in SUFFIXES)
        for f in files:
            if f == GLOSSARY or not f.is_file():
                continue
            for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
                m = pattern.search(line)
                if m:
                    found.append(f"{f.relative_to(ROOT)}:{n}: {m.group(0)}")
    return found


def test_every_link_on_the_glossary_leads_to_a_page_and_heading_that_exist():
    text = GLOSSARY.read_text()
    assert len(LINK.findall(text)) >= len(entries(text))
    assert broken_links(GLOSSARY) == []


def test_every_entry_defines_its_word_and_links_to_where_it_is_used():
    found = entries(GLOSSARY.read_text())
    assert {"Load matching", "Knee", "Lease", "Variant guard", "Load guard", "Minimum share"} <= set(found)
    for term, body in found.items():
        assert LINK.search(body), f"{term}: no link to the guide that uses it"
        assert len(body.split()) >= 8, f"{term}: no definition"


def test_no_retired_word_is_used_again():
    words = retired(GLOSSARY.read_text())
    assert {"evening", "evened", "evens"} <= set(words)
    assert uses(words) == []


def test_the_checks_catch_what_they_are_for(tmp_path):
    """A retired word in a scanned file, and a link to a missing page or heading, are reported."""
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n## Real heading\n\n[ok](#real-heading) [gone](missing.md) [bad](#no-such)\n")
    assert [b.split(":")[0] for b in broken_links(page)] == ["missing.md", "#no-such"]
    assert anchor("Retries before the first byte") == "retries-before-the-first-byte"
    assert anchor("Owned, rented") == "owned-rented"
    assert retired("## Retired words\n\n| retired | say instead |\n|---|---|\n| foo, foos | bar |\n") == ["foo", "foos"]
