"""A child Python process on a small private tmpfs: a file system that fills up, without touching the host's.

``run_on_private_tmpfs(child, args, mount_at=..., tmpfs_bytes=...)`` runs ``child`` (Python source) under
``unshare --mount`` after mounting a tmpfs of ``tmpfs_bytes`` at ``mount_at``; the child sees
``sys.argv[1:] == args`` and reports by printing one JSON object as its last line, which is returned. The test
is skipped where a mount namespace or a tmpfs cannot be made here.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

_MOUNT_THEN_RUN = r"""
import json, subprocess, sys
mount_at, size, child = sys.argv[1], sys.argv[2], sys.argv[3]
try:
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", mount_at], check=True)
except (OSError, subprocess.CalledProcessError) as error:
    print(json.dumps({"mount_error": str(error)}))
    sys.exit(0)
sys.argv = [sys.argv[0], *sys.argv[4:]]
exec(compile(child, "<child on a private tmpfs>", "exec"), {"__name__": "__main__"})
"""


def run_on_private_tmpfs(
    child: str, args: Sequence[str], *, mount_at: Path, tmpfs_bytes: int, timeout: float
) -> dict[str, Any]:
    """The JSON object ``child`` printed last, run as the module docstring says (skips the test where it cannot
    run); a non-zero exit or a traceback fails the test with the child's stderr."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("needs unshare and mount")
    proc = subprocess.run(
        ["unshare", "--mount", "--", sys.executable, "-c", _MOUNT_THEN_RUN, str(mount_at), str(tmpfs_bytes), child,
         *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )  # fmt: skip
    if proc.returncode != 0 and "unshare" in proc.stderr and "Operation not permitted" in proc.stderr:
        pytest.skip(f"cannot make a mount namespace here: {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    if "mount_error" in result:
        pytest.skip(f"cannot mount a tmpfs here: {result['mount_error']}")
    return result
