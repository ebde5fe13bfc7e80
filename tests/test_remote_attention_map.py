"""docs/remote_attention.md's "Where the code is" stays true to the tree: every file it names exists, and
every module of the feature's own folders (sglang_ext/offload/, sglang_ext/transport/) is on it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def mapped() -> list[str]:
    text = (ROOT / "docs" / "remote_attention.md").read_text()
    section = text.split("## Where the code is", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+)` \|", section, re.M)


def test_every_mapped_path_exists() -> None:
    paths = mapped()
    assert len(paths) > 30
    assert [p for p in paths if not (ROOT / p).exists()] == []


def test_the_features_own_folders_are_mapped_whole() -> None:
    paths = set(mapped())
    for folder in ("sglang_ext/offload", "sglang_ext/transport"):
        files = {f"{folder}/{p.name}" for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py"}
        assert files - paths == set(), folder
