#!/usr/bin/env bash
# Set up (if needed) and serve the embedded default model on 127.0.0.1:30000 (extra flags pass through).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m sglang_ext.launch "$@"
