"""Where the tests live, the environment that lets a script started as a subprocess import ``support``, and
writing a file such a script polls for."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: ``tests/``: the folder ``support`` is a package of.
TESTS_DIR = Path(__file__).resolve().parents[1]
ROOT = TESTS_DIR.parent


def subprocess_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default ``os.environ``) with ``tests/`` first on ``PYTHONPATH``, for ``python SCRIPT`` runs
    of the scripts under ``tests/`` that import ``support``."""
    env = dict(os.environ if base is None else base)
    rest = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(TESTS_DIR) if not rest else os.pathsep.join([str(TESTS_DIR), rest])
    return env


def write_json_whole(path: Path, value: Any) -> None:
    """Write ``value`` as JSON to ``path`` whole: a process polling for the name never reads a half-written file
    (written under a temp name, then renamed into place)."""
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(json.dumps(value))
    temp.rename(path)
