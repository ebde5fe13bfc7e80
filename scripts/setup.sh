#!/usr/bin/env bash
# One-time setup on a fresh machine: a virtualenv in .venv with the pinned, tested versions.
# Idempotent: re-running is a no-op unless pyproject.toml or this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.setup-stamp
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [[ -f $stamp && $(cat $stamp) == "$want" ]]; then exit 0; fi
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
# This machine's pip config names local index folders that may not exist; pip warns per package.
pip() { .venv/bin/python -m pip "$@" 2> >(grep -v "is neither a file nor a directory" >&2); }
pip install -q --upgrade pip
# torch is pinned to the CPU build (a plain `torch` requirement would pull a multi-GB CUDA build);
# on a GPU machine install the project with --no-deps beside the torch already there.
pip install -q -e ".[test]"
# The SGLang frontend (sgl.function, RuntimeEndpoint) for frontend tests: its wheel declares the
# whole GPU runtime as requirements, so install it alone plus what the frontend imports.
pip install -q --no-deps "sglang==0.5.23"
pip install -q $(grep -v '^#' scripts/frontend-requirements.txt)
echo "$want" > $stamp
echo "setup done: $(.venv/bin/python -c 'import torch, sglang_ext; print("torch", torch.__version__, "sglang_ext", sglang_ext.__version__)')"
