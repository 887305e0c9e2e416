"""Every repository path the README and docs name exists (tests, sources, configs, benchmarks,
docs), so the pointers cannot go stale silently."""

from __future__ import annotations

import re

from conftest import REPO

PATH = re.compile(r"(?<![\w/.<-])((?:tests|src|configs|benchmarks|docs)/[\w./-]+\.(?:py|yaml|md))")


def test_every_named_repository_path_exists():
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    missing = []
    for page in pages:
        for match in PATH.finditer(page.read_text()):
            if not (REPO / match.group(1)).exists():
                missing.append(f"{page.relative_to(REPO)}: {match.group(1)}")
    assert not missing, "stale paths:\n" + "\n".join(missing)
