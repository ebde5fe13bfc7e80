"""The MoE kernels leave the ints that change with the batch unspecialized (do_not_specialize): otherwise
Triton compiles a new variant of a kernel the first time a batch brings another divisibility of one of them,
in the middle of serving. Checked on the compiled (not interpreted) JIT functions, in a process of its own
since the CPU tests run Triton under its interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent
PROBE = """
import inspect, json
import sglang_ext.ops.moe.align as a, sglang_ext.ops.moe.kernels as k, sglang_ext.ops.moe.route as r
out = {}
for f in (k._gate_up_kernel, k._down_kernel, a._count_kernel, a._place_kernel, r._route_kernel):
    out[f.fn.__name__] = {"unspecialized": [p.name for p in f.params if p.do_not_specialize],
                          "args": list(inspect.signature(f.fn).parameters)}
print(json.dumps(out))
"""


def test_the_batch_sizes_the_moe_kernels_take_are_not_specialized() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    got = json.loads(subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT, check=True,
                                    capture_output=True, text=True).stdout)
    want = {"_gate_up_kernel": ["n_pairs", "num_blocks_m"], "_down_kernel": ["n_pairs", "num_blocks_m"],
            "_count_kernel": ["n"], "_place_kernel": ["n"], "_route_kernel": ["n_rows"]}
    assert {name: g["unspecialized"] for name, g in got.items()} == want
    # every other int those kernels take is fixed by the model (widths, strides, k, expert counts)
    batch_like = {"n", "n_pairs", "num_blocks_m", "n_rows", "t", "tokens", "num_tokens"}
    for name, g in got.items():
        assert batch_like & set(g["args"]) <= set(want[name]), name
