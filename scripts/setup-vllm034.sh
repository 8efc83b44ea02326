#!/usr/bin/env bash
# Prepare .venv-vllm034: the vLLM 0.34 wheel layered over .venv's CPU torch (see setup-vllm03x.sh).
set -euo pipefail
exec "$(dirname "$0")/setup-vllm03x.sh" 0.34.0 "${VENV034:-.venv-vllm034}"
