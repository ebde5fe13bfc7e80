"""`python -m sglang_ext.worker ROUTER_ADDR WORKER_ID ARGS_JSON`: the process the Engine and the
launcher start. Server arguments arrive as JSON (never pickle)."""

from __future__ import annotations

import faulthandler
import signal
import sys

from sglang_ext.worker.server import run_worker_encoded

if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: python -m sglang_ext.worker ROUTER_ADDR WORKER_ID ARGS_JSON")
    # `kill -USR1 PID` prints every thread's stack to stderr (the launcher's log): a worker that stops
    # answering can be diagnosed without stopping it.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    run_worker_encoded(sys.argv[3].encode(), sys.argv[1], sys.argv[2])
