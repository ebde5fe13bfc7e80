#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite on CPU. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Quiet by default with exactly one -q: pytest -qq (ours plus the caller's -q) drops the summary
# line ("N passed in Ns"), which every run must end with. -v from the caller replaces our -q.
args=()
quiet=(-q)
for a in "$@"; do
  case $a in
    -q | -qq | -qqq | --quiet) ;;
    -v | -vv | -vvv | --verbose | --verbosity=*) quiet=(); args+=("$a") ;;
    *) args+=("$a") ;;
  esac
done
exec .venv/bin/python -m pytest ${quiet[@]+"${quiet[@]}"} ${args[@]+"${args[@]}"}
