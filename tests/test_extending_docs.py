"""Each docs/extending/ page's example trains through the normal entry, as the page says.

The page's Python block is saved as the module it names (`# my_x.py: ...` on its first line) in a
directory outside `src/`, and the page's `uv run python -m <package>.train ...` command runs
verbatim from there (repo-relative config paths made absolute, plus `--output-dir`)."""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_module

PAGES = sorted(p for p in (REPO / "docs" / "extending").glob("*.md") if p.name != "README.md")


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, flags=re.S | re.M)


def test_every_registry_has_a_page():
    names = {p.stem for p in PAGES}
    assert names == {
        "direct_alignment_loss", "policy_gradient_loss", "advantage_estimator",
        "reward_function", "reward_model_loss",
    }  # fmt: skip
    index = (REPO / "docs" / "extending" / "README.md").read_text()
    assert all(f"({p.name})" in index for p in PAGES)


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_page_example_trains_through_the_normal_entry(page: Path, tmp_path: Path):
    text = page.read_text()
    (code,) = code_blocks(text, "python")
    filename = re.match(r"# (\w+\.py):", code).group(1)
    lines = code.strip().splitlines()
    assert len([x for x in lines if x.strip()]) <= 20, f"{page.name}: the example grew past 15ish"
    (tmp_path / filename).write_text(code)
    registered = re.search(r'\.register\("(\w+)"\)', code).group(1)

    (command,) = [b.strip() for b in code_blocks(text, "bash") if "python -m" in b]
    argv = shlex.split(command)
    assert argv[:4] == ["uv", "run", "python", "-m"], command
    module, args = argv[4], argv[5:]
    assert module.endswith(".train") and f"--import {filename[:-3]}" in command
    args = [
        str(REPO / a) if not Path(a).is_absolute() and (REPO / a).is_file() else a for a in args
    ]
    run_dir = tmp_path / "run"
    result = run_module(module, *args, "--output-dir", str(run_dir), cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]

    saved = (run_dir / "config.yaml").read_text()
    assert re.search(rf"\bname: {registered}\b", saved), saved
    assert yaml.safe_load(saved)["imports"] == [filename[:-3]]
    losses = [
        row["train/loss"]
        for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "train/loss" in row
    ]
    assert losses and all(math.isfinite(x) for x in losses)
