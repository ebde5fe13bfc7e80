"""Build, on a machine without a GPU, the FlashInfer kernels the GPU tests and benchmarks JIT-compile,
so a fresh device machine loads them instead of compiling for ~10 minutes of its lease.

On a fresh H100 (2026-12-06) the GPU suite's first run spent ~10 minutes in FlashInfer's JIT (the
sampling module ~4 min, top-k ~3, attention for head dims 64 and 128) and hit its time limits; with the
kernels cached a run takes ~3 minutes. This builds the same modules with nvcc for sm_90a (Hopper:
H100 and H200) and writes them in the layout `bench/gpu_session.sh` unpacks into FlashInfer's AOT
folder (`<uri>/<uri>.so` in `.whl/fi_so.tgz`).

    python bench/build_fi_cache.py --out .whl/fi_so.tgz [--jobs 2] [--include DIR]
    (bash bench/prepare_device.sh does it all: the wheels, a build venv, the curand headers, this)

Needs nvcc (CUDA 13, as on the GPU machine), ninja and flashinfer-python==0.6.14 with its tvm-ffi;
torch may be a CPU build. The sampling module includes curand.h, which the CPU machine's toolkit lacks:
`pip download --no-deps nvidia-curand==10.4.5.25`, unzip it and pass `--include <it>/nvidia/cu13/include`
(added to nvcc's flags through NVCC_APPEND_FLAGS). The modules are the ones the device's own JIT
produced (their names are FlashInfer's URIs), so a kernel set that drifts from what the code asks for
simply JITs as before.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tarfile
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

HEAD_DIMS = (64, 128)  # 64: the embedded default model; 128: Llama/Qwen/Mixtral geometries and the tests


def _cpu_safe_import() -> None:
    """FlashInfer reads the device's SM count at import; give it an H100's where torch has no CUDA."""
    import torch

    if not torch.cuda.is_available():
        props = SimpleNamespace(multi_processor_count=132, major=9, minor=0, name="sm_90 (build only)",
                                total_memory=80 << 30)
        torch.cuda.get_device_properties = lambda *a, **k: props  # type: ignore[assignment]
        torch.cuda.get_device_capability = lambda *a, **k: (9, 0)  # type: ignore[assignment]
    import flashinfer  # noqa: F401  (imported here, after the stand-in, so its import-time query succeeds)


def _specs() -> list[Any]:
    import torch

    _cpu_safe_import()
    if os.environ.get("BUILD_FI_CUTLASS_MOE"):  # issue 33: what FlashInfer's CUTLASS MoE costs to build
        from flashinfer.jit.fused_moe import gen_cutlass_fused_moe_sm90_module

        return [gen_cutlass_fused_moe_sm90_module()]
    from flashinfer.jit.attention.modules import gen_batch_decode_module, gen_batch_prefill_module
    from flashinfer.jit.sampling import gen_sampling_module
    from flashinfer.jit.topk import gen_topk_module

    bf, i32 = torch.bfloat16, torch.int32
    specs = [gen_sampling_module(), gen_topk_module()]
    for d in HEAD_DIMS:
        specs.append(gen_batch_decode_module(bf, bf, bf, i32, d, d, 0, False, False))
        specs.append(gen_batch_prefill_module("fa2", bf, bf, bf, i32, d, d, 0, False, False, False))
    return specs


def _link_env(stub_dir: Path) -> None:
    """FlashInfer links each module with -lcudart -lcuda from the toolkit's lib64 and its stubs. A CPU
    machine's toolkit may keep libcudart elsewhere and has no driver stub: point the linker at the
    runtime and at empty stand-ins (the modules the GPU machine builds need only libcudart.so.13)."""
    homes = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    libs = [str(Path(h, d)) for h in homes if h for d in ("lib64", "lib") if Path(h, d, "libcudart.so").exists()]
    # the driver (every module) and NVRTC (only the CUTLASS MoE): present on the GPU machine at run time
    for lib, soname in (("cuda", "libcuda.so.1"), ("nvrtc", "libnvrtc.so.13")):
        if any(Path(d, f"lib{lib}.so").exists() for d in ("/usr/local/lib64/stubs", *libs)):
            continue
        stub_dir.mkdir(parents=True, exist_ok=True)
        (stub_dir / "stub.c").write_text("/* link-time stand-in for a library of the GPU machine */\n")
        subprocess.run(["cc", "-shared", f"-Wl,-soname,{soname}", "-o", str(stub_dir / f"lib{lib}.so"),
                        str(stub_dir / "stub.c")], check=True)
        if str(stub_dir) not in libs:
            libs.append(str(stub_dir))
    os.environ["LIBRARY_PATH"] = os.pathsep.join([*libs, *filter(None, [os.environ.get("LIBRARY_PATH")])])


def _build(name: str) -> tuple[str, float, str]:
    t0 = time.time()
    spec = next(s for s in _specs() if s.name == name)
    spec.build(verbose=False)
    return name, time.time() - t0, str(spec.jit_library_path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".whl/fi_so.tgz")
    ap.add_argument("--jobs", type=int, default=2, help="modules built at once (each runs its own nvcc)")
    ap.add_argument("--only", nargs="*", help="build only these module names (default: all)")
    ap.add_argument("--include", action="append", default=[], help="extra header folder for nvcc (curand.h)")
    ap.add_argument("--cutlass-moe", action="store_true",
                    help="build only FlashInfer's CUTLASS fused MoE for sm_90a (to time it; not used by the engine)")
    a = ap.parse_args()
    if a.cutlass_moe:
        os.environ["BUILD_FI_CUTLASS_MOE"] = "1"  # read by _specs in the worker processes too
    if a.include:
        flags = " ".join(f"-I{d}" for d in a.include)
        os.environ["NVCC_APPEND_FLAGS"] = f"{os.environ.get('NVCC_APPEND_FLAGS', '')} {flags}".strip()
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0")  # sm_90a: H100 and H200
    _link_env(Path(tempfile.mkdtemp(prefix="libcuda-stub-")))
    names = [s.name for s in _specs() if not a.only or s.name in a.only]
    built = []
    with ProcessPoolExecutor(a.jobs) as pool:
        for name, secs, path in pool.map(_build, names):
            print(f"built {name} in {secs:.0f} s ({Path(path).stat().st_size / 1e6:.1f} MB)", flush=True)
            built.append((name, Path(path)))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:gz") as tar:
        for name, path in built:
            tar.add(path, arcname=f"{name}/{name}.so")
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB, {len(built)} modules)")


if __name__ == "__main__":
    main()
