"""bench/slim_wheels.py: FlashInfer's JIT headers leave the carried wheel, everything else stays byte-equal."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from bench.slim_wheels import slim_folder


def _wheel(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("flashinfer/__init__.py", "x = 1\n")
        z.writestr("flashinfer/data/cutlass/include/a.h", "#pragma once\n" * 100)
        z.writestr("flashinfer/data/cccl/b.h", "#pragma once\n")
        z.writestr("flashinfer/data/csrc/c.cu", "// kept\n")
        record = "flashinfer/__init__.py,,\nflashinfer/data/cutlass/include/a.h,,\nflashinfer/data/cccl/b.h,,\n"
        z.writestr("flashinfer_python-0.6.14.dist-info/RECORD", record + "flashinfer/data/csrc/c.cu,,\n")


def test_slim_folder_drops_only_the_jit_headers(tmp_path: Path) -> None:
    src, dst = tmp_path / "whl", tmp_path / "slim"
    src.mkdir()
    _wheel(src / "flashinfer_python-0.6.14-py3-none-any.whl")
    (src / "fi_so.tgz").write_bytes(b"kernels")
    (src / "msgspec-0.23.0.whl").write_bytes(b"other wheel")
    saved = slim_folder(src, dst)
    assert saved > 0
    assert (dst / "fi_so.tgz").read_bytes() == b"kernels"
    assert (dst / "msgspec-0.23.0.whl").read_bytes() == b"other wheel"
    with zipfile.ZipFile(dst / "flashinfer_python-0.6.14-py3-none-any.whl") as z:
        names = z.namelist()
        record = z.read("flashinfer_python-0.6.14.dist-info/RECORD").decode()
    assert "flashinfer/__init__.py" in names and "flashinfer/data/csrc/c.cu" in names
    assert not any(n.startswith(("flashinfer/data/cutlass/", "flashinfer/data/cccl/")) for n in names)
    assert "cutlass" not in record and "cccl" not in record and "csrc/c.cu" in record


def test_slim_folder_refuses_a_missing_source_and_its_own_source(tmp_path: Path) -> None:
    src = tmp_path / "whl"
    with pytest.raises(ValueError, match="no wheel folder"):
        slim_folder(src, tmp_path / "slim")
    src.mkdir()
    (src / "fi_so.tgz").write_bytes(b"kernels")
    for dst in (src, tmp_path):  # the folder itself, or one that holds it: the wheels must survive
        with pytest.raises(ValueError, match="would replace"):
            slim_folder(src, dst)
    assert (src / "fi_so.tgz").read_bytes() == b"kernels"
