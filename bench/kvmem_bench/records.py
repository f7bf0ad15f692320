"""What every benchmark writes beside its numbers: JSON-lines records (appended as they are made, so an
interrupted run resumes), and the commit and state of the code that made them."""

from __future__ import annotations

import json
import os
import subprocess
from datetime import datetime, timezone
from pathlib import Path


def read_records(path: Path) -> list[dict]:
    """Every record of a JSON-lines file (none if it does not exist)."""
    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def append_record(path: Path, record: dict) -> None:
    """One record, appended in one write (processes side by side append to the same file)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def git_commit() -> str:
    """The short commit of the checkout the benchmark runs from ("unknown" outside one)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=5).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def uncommitted_changes() -> bool | None:
    """Whether the code differs from the commit (results/ aside: a benchmark writes its own results as it runs);
    None outside a git checkout."""
    try:
        r = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ":(top)", ":(top,exclude)results"],
                           capture_output=True, text=True, cwd=Path(__file__).parent, timeout=5)
        return bool(r.stdout.strip()) if r.returncode == 0 else None
    except OSError:
        return None


def now() -> str:
    """The UTC time, to the second, as runs record it."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
