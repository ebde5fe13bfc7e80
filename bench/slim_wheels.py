"""Copy the device wheel folder without FlashInfer's bundled C++ headers, so a call fits the 64 MiB it may carry.

FlashInfer's wheel ships CUTLASS and CCCL (~9 MB compressed) for its JIT compiler. A device call loads every
kernel it runs from ``fi_so.tgz`` (built on the CPU machine by bench/prepare_device.sh), so those headers are
never read there; without them the tracked tree (~37 MB on disk by 2026-12-07) and the wheels fit again.
A kernel missing from ``fi_so.tgz`` then fails at once (no header to compile against) instead of compiling for
~10 minutes -- the call wasted either way.

    python bench/slim_wheels.py .whl .whl-slim      # then carry [".whl-slim"]; bench/gpu_session.sh finds it
"""

from __future__ import annotations

import argparse
import shutil
import zipfile
from pathlib import Path

DROPPED = ("flashinfer/data/cutlass/", "flashinfer/data/cccl/")


def slim_wheel(src: Path, dst: Path, dropped: tuple[str, ...] = DROPPED) -> int:
    """Write ``src`` to ``dst`` without entries under ``dropped`` (and their RECORD lines); bytes left out."""
    saved = 0
    prefixes = tuple(p.encode() for p in dropped)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if info.filename.startswith(dropped):
                saved += info.compress_size
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                # pip installs the files RECORD names; a line for a file not in the archive would be stale
                data = b"".join(line for line in data.splitlines(True) if not line.startswith(prefixes))
            zout.writestr(info, data)
    return saved


def slim_folder(src: Path, dst: Path) -> int:
    """``dst`` becomes ``src`` with every FlashInfer wheel slimmed; returns the bytes saved."""
    if not src.is_dir():
        raise ValueError(f"{src}: no wheel folder there (bash bench/prepare_device.sh makes .whl)")
    if dst.resolve() == src.resolve() or src.resolve().is_relative_to(dst.resolve()):
        raise ValueError(f"{dst}: would replace the folder it copies from ({src})")
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    saved = 0
    for path in sorted(src.iterdir()):
        if path.is_file() and path.name.startswith("flashinfer_python-") and path.suffix == ".whl":
            saved += slim_wheel(path, dst / path.name)
        elif path.is_file():
            shutil.copy2(path, dst / path.name)
    return saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="the full wheel folder (bench/prepare_device.sh's, e.g. .whl)")
    ap.add_argument("dst", type=Path, help="the folder to carry instead (replaced)")
    args = ap.parse_args()
    try:
        saved = slim_folder(args.src, args.dst)
    except ValueError as e:
        ap.error(str(e))
    total = sum(p.stat().st_size for p in args.dst.iterdir())
    print(f"wrote {args.dst}: {total >> 20} MiB ({saved >> 20} MiB of FlashInfer's JIT headers left out)")


if __name__ == "__main__":
    main()
