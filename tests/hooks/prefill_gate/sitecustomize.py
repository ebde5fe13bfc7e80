"""A test hook, loaded by the interpreter at startup (`sitecustomize`) in the one worker whose environment
puts this directory on PYTHONPATH -- ahead of the repository root, which must come next (see
tests/test_disagg_failures.py): it holds the worker's forward thread in the middle of a prefill, so that
a test can act on a request known to be in prefill instead of racing it.

With $SGLANG_EXT_TEST_PREFILL_GATE naming a file: whenever that file exists after a step that left a
request running (a long prompt is prefilled over many steps of `chunked_prefill_size` tokens), the worker
creates FILE.held and waits until FILE is removed. Its event loop goes on meanwhile: it heartbeats and
its load reports show the request running. Without the file the hook costs one stat per step.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

_gate = os.environ.get("SGLANG_EXT_TEST_PREFILL_GATE")
if _gate:
    from sglang_ext.worker.worker import Worker

    _step = Worker.step
    gate = Path(_gate)

    def _held_step(self: Worker, inbox: list[Any]) -> list[Any]:
        out = _step(self, inbox)
        if gate.exists() and self.scheduler.stats().num_running > 0:
            gate.with_name(gate.name + ".held").touch()
            while gate.exists():
                time.sleep(0.01)
        return out

    Worker.step = _held_step  # type: ignore[method-assign]
