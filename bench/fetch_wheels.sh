#!/usr/bin/env bash
# Download the wheels a GPU machine without network lacks (Python 3.12, x86-64): FlashInfer with its
# runtime pieces and this project's light dependencies, at the versions tested there. Run from the
# repository root on a machine with network, then carry the folder:
#   bash bench/fetch_wheels.sh [DIR [EXTRA==VERSION ...]]        (DIR: .whl; git-ignored)
# bench/gpu_session.sh installs DIR/*.whl into /tmp/site first thing on the GPU machine.
set -euo pipefail
dir=${1:-.whl}; shift || true
mkdir -p "$dir"
platforms=()
for p in manylinux_2_17 manylinux2014 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34; do
  platforms+=(--platform "${p}_x86_64")
done
# nvidia-cudnn-frontend (11.6 MB) is left out: FlashInfer imports cudnn only inside try/except (its cuDNN
# attention and FP4 GEMM paths, which this project does not call), and a call carries at most 64 MiB.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" --platform any -d "$dir" \
  flashinfer-python==0.6.14 apache-tvm-ffi==0.1.11 cuda-tile==1.7.0 \
  pyzmq==27.3.0 msgspec==0.23.0 fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 \
  uvicorn==0.54.0 typing-inspection==0.4.5 annotated-types==0.8.0 opentelemetry-api==1.45.2 \
  httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 "$@"
ls -1 "$dir"
