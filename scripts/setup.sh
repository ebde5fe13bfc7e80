#!/usr/bin/env bash
# One-time setup on a fresh machine: a virtualenv in .venv with the pinned, tested versions.
# Idempotent: re-running is a no-op unless pyproject.toml or this script changed.
# Quiet when all is well (one line per stage); a failing step shows pip's whole output.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.setup-stamp
want=$(cat pyproject.toml scripts/setup.sh scripts/frontend-requirements.txt | sha256sum | cut -d' ' -f1)
if [[ -f $stamp && $(cat $stamp) == "$want" ]]; then exit 0; fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
# step "what" cmd...: one line, then the command's output only if it fails.
step() {
  local what=$1
  shift
  echo "setup: $what"
  if ! "$@" >"$log" 2>&1; then
    # This machine's pip config may name local index folders that do not exist; pip warns once
    # per package about each, which buries the real error.
    grep -v "is neither a file nor a directory" "$log" >&2 || true
    echo "setup: FAILED: $what (output above)" >&2
    exit 1
  fi
}
pip() { .venv/bin/python -m pip --disable-pip-version-check "$@"; }

if [[ ! -x .venv/bin/python ]]; then
  step "creating .venv ($("$PY" --version 2>&1))" "$PY" -m venv .venv
fi
step "upgrading pip" pip install -q --upgrade pip
# torch is pinned to the CPU build (a plain `torch` requirement would pull a multi-GB CUDA build);
# on a GPU machine install the project with --no-deps beside the torch already there.
step "installing sglang_ext and test dependencies (torch CPU build; the first time takes a minute or two)" \
  pip install -q -e ".[test]"
# The SGLang frontend (sgl.function, RuntimeEndpoint) for frontend tests: its wheel declares the
# whole GPU runtime as requirements, so it goes in alone (--no-deps) after what the frontend
# really imports. pip's after-install check would then list every GPU requirement of sglang as
# an error although nothing is wrong: --no-warn-conflicts.
frontend() {  # `&&`: set -e does not apply inside a function that `step` runs as a condition
  pip install -q --no-warn-conflicts $(grep -v '^#' scripts/frontend-requirements.txt) &&
    pip install -q --no-deps --no-warn-conflicts "sglang==0.5.23"
}
step "installing the SGLang frontend 0.5.23 (for frontend tests; without its GPU runtime)" frontend
echo "$want" > $stamp
echo "setup: done ($(.venv/bin/python -c 'import torch, sglang_ext; print("torch", torch.__version__, "sglang_ext", sglang_ext.__version__)'))"
