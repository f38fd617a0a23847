"""The documentation holds together: every relative link in the repository's Markdown files points to a
file (and, for a link into a Markdown file, a heading) that exists, and the README stays short."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_BYTES = 13_500  # a page for users; what runs long goes to docs/

# [text](target) and [text](target "title"); images too. Inline code and fenced blocks are removed first.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE = re.compile(r"`[^`\n]*`")


def markdown_files() -> list[Path]:
    """The repository's Markdown files: tracked ones and new ones git does not ignore (outside a git
    checkout, e.g. an exported tree: every *.md outside hidden folders, jobs/ and templates_cache/)."""
    done = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"],
                          cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode == 0:
        return sorted(ROOT / line for line in done.stdout.splitlines() if (ROOT / line).is_file())
    skip = {"jobs", "templates_cache"}
    return sorted(p for p in ROOT.rglob("*.md")
                  if not any(part.startswith(".") or part in skip for part in p.relative_to(ROOT).parts))


def links(text: str) -> list[str]:
    text = CODE.sub("", FENCE.sub("", text))
    return LINK.findall(text)


def anchors(path: Path) -> set[str]:
    """The anchors a code host gives a Markdown file's headings (lower case, punctuation dropped,
    spaces as hyphens, repeats numbered)."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def problems(path: Path) -> list[str]:
    found = []
    for target in links(path.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
            continue
        file_part, _, fragment = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}: {target}"
        if not dest.exists():
            found.append(f"{where}: no such file")
        elif ROOT not in dest.parents and dest != ROOT:
            found.append(f"{where}: outside the repository")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            found.append(f"{where}: no heading #{fragment} in {dest.relative_to(ROOT)}")
    return found


def test_there_are_markdown_files_with_links():
    files = markdown_files()
    assert ROOT / "README.md" in files
    assert sum(len(links(f.read_text(encoding="utf-8"))) for f in files) > 20


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path):
    assert not problems(path), "\n".join(problems(path))


def test_the_readme_is_short():
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_MAX_BYTES, (f"README.md is {size} bytes (at most {README_MAX_BYTES}): move details "
                                      "to docs/ and link to them")


def test_the_link_checker_finds_broken_links(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    (tmp_path / "a.md").write_text("# Title\n\n## Some section\n")
    doc = tmp_path / "b.md"
    doc.write_text("[ok](a.md) [ok](a.md#some-section) [web](https://example.org/x.md) `[code](no.md)`\n"
                   "[missing](no.md) [bad anchor](a.md#nothing)\n```\n[fenced](no2.md)\n```\n")
    found = problems(doc)
    assert len(found) == 2, found
    assert "no such file" in found[0] and "no heading #nothing" in found[1]
