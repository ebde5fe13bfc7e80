#!/usr/bin/env bash
# Everything a device session carries, made on this (CPU, networked) machine before the first call:
#   .whl/*.whl      the wheels the GPU machine lacks (bench/fetch_wheels.sh)
#   .whl/fi_so.tgz  FlashInfer's JIT kernels for sm_90a (H100/H200), built here with nvcc
#                   (bench/build_fi_cache.py), which bench/gpu_session.sh loads as AOT modules
# so the first call on a fresh machine spends no device time compiling (~10 minutes on 2026-12-06).
# Usage (repository root):  bash bench/prepare_device.sh [DIR]      (DIR default .whl; git-ignored)
# Needs nvcc 13 on PATH (this machine has it). Builds in a throwaway venv under ${FI_VENV:-/tmp/fi-build-venv}.
set -euo pipefail
dir=${1:-.whl}
quiet() { "$@" 2>&1 | { grep -v -E "^WARNING: Location|^$" || true; }; }  # pip's notes on this machine's index
quiet bash bench/fetch_wheels.sh "$dir" > /dev/null
venv=${FI_VENV:-/tmp/fi-build-venv}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  quiet "$venv/bin/pip" install -q torch==2.13.0 ninja numpy requests apache-tvm-ffi==0.1.11 \
    "$dir"/flashinfer_python-0.6.14-py3-none-any.whl
fi
# sampling.cuh includes curand.h, which this machine's toolkit lacks: the headers of CUDA 13's curand wheel
inc=$venv/curand
if [ ! -f "$inc/nvidia/cu13/include/curand.h" ]; then
  quiet "$venv/bin/pip" download -q --no-deps nvidia-curand==10.4.5.25 -d "$inc"
  (cd "$inc" && python3 -m zipfile -e nvidia_curand-*.whl .)
fi
"$venv/bin/python" bench/build_fi_cache.py --out "$dir/fi_so.tgz" --jobs 2 --include "$inc/nvidia/cu13/include" \
  2>&1 | grep -E "^built|^wrote|Error|error:" || { echo "prepare_device: FlashInfer build FAILED" >&2; exit 1; }
ls -la "$dir/fi_so.tgz"
# a call carries the tracked and untracked-not-ignored files plus what it names: at most 64 MiB together, counted
# here on disk (blocks), as the device counted them on 2026-12-07 (the tree 38.6 MB on disk, 33.6 MB apparent)
tree=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 du -c -B1 2>/dev/null | awk '$2 == "total" {s += $1} END {print s}')
python3 bench/slim_wheels.py "$dir" "$dir-slim"  # the same without FlashInfer's JIT headers (the kernels are built)
carry=$(du -sb "$dir-slim" | cut -f1)
echo "a call carrying $dir-slim would carry $(( (tree + carry) >> 20 )) MiB (tree $(( tree >> 20 )), $dir-slim $(( carry >> 20 ))); the limit is 64"
[ $(( (tree + carry) >> 20 )) -lt 62 ] || echo "prepare_device: WARNING: within 2 MiB of the device's 64 MiB limit" >&2
