#!/usr/bin/env bash
# Prepare .venv-vllm033: the vLLM 0.33 wheel layered over .venv's CPU torch (see setup-vllm03x.sh).
set -euo pipefail
exec "$(dirname "$0")/setup-vllm03x.sh" 0.33.0 "${VENV033:-.venv-vllm033}"
