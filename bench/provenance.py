"""What ran: the commit and dirtiness of the tree a benchmark runs from, and the driver call it belongs to.

Every report of bench/serving.py and bench/offline.py carries these (issue 32: a figure names the commit that
really ran). Kept apart from serving.py so that a GPU-only script imports it without the HTTP client.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from datetime import datetime, timezone
from typing import Any

from bench.traces import repo_root

COMMIT_ENV = "SGLANG_EXT_COMMIT"  # set by the caller where the tree that runs has no git (a copied tree)
DIRTY_ENV = "SGLANG_EXT_DIRTY"  # ... and whether that tree had uncommitted changes (1/0)
CALL_ENV = "SGLANG_EXT_CALL_ID"


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(repo_root()), *args], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def git_commit() -> str | None:
    head = _git("rev-parse", "HEAD")
    return head.strip() or None if head is not None else None


def new_call_id(kind: str) -> str:
    """An id for one driver invocation: kind, UTC time, and a random tail (two calls in one second)."""
    return f"{kind}-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:6]}"


def _flag(text: str | None) -> bool | None:
    if text is None:
        return None
    low = text.strip().lower()
    return True if low in ("1", "true", "yes") else False if low in ("0", "false", "no") else None


def provenance(call_id: str | None = None) -> dict[str, Any]:
    """What ran: the caller's $SGLANG_EXT_COMMIT / $SGLANG_EXT_DIRTY when set (first, because a copied tree
    can carry a stale .git: the device machine's git reports the commit its copy started from, not the
    tree that was sent), else the commit and dirtiness git sees, else "unknown" / null; and the driver
    call the run belongs to."""
    dirty: bool | None = None
    if os.environ.get(COMMIT_ENV):
        commit, source, dirty = os.environ[COMMIT_ENV].strip(), "env", _flag(os.environ.get(DIRTY_ENV))
    elif (head := git_commit()) is not None:
        commit, source = head, "git"
        status = _git("status", "--porcelain")
        dirty = bool(status.strip()) if status is not None else None
    else:
        commit, source = "unknown", "unknown"
    call = call_id or os.environ.get(CALL_ENV) or new_call_id("serving")
    return {"git_commit": commit, "git_dirty": dirty, "commit_source": source, "call_id": call}
