"""A child of tests/test_disagg_shutdown.py: one end of a real gloo KV pair -- a `WorkerDisagg` over a small
KV pool, no model -- that stops the way a worker does, through `sglang_ext.worker.server.finish`.

    python tests/_disagg_exit_child.py decode        opens the pair: prints its store address, then
                                                     `linked` once the prefill end has connected
    python tests/_disagg_exit_child.py prefill ADDR  connects to it

Then each reads one line on stdin: `stop` finishes (as a worker does at shutdown), `linger` never does
(a peer that stays up, silent). Both log to stderr at INFO.
"""

from __future__ import annotations

import logging
import sys
import time
from types import SimpleNamespace
from typing import Any, cast

import torch

from sglang_ext.kvcache.pool import KVGeometry, KVPool
from sglang_ext.messages import KVPairConnect, KVPairOpen
from sglang_ext.worker.disagg import WorkerDisagg
from sglang_ext.worker.server import finish

PAIRING = "pair-x"
TIMEOUT_S = 120.0  # the connect wait too: on a loaded 2-core machine the peer takes seconds to import torch


def fake_worker(mode: str) -> Any:
    pool = KVPool(KVGeometry(num_layers=1, num_kv_heads=1, head_dim=8, page_size=4, dtype=torch.float32), 8, "cpu")
    runner = SimpleNamespace(device=torch.device("cpu"), pool=pool, args=SimpleNamespace(disable_pd_kv_ipc=False))
    disagg = WorkerDisagg(mode, cast(Any, runner), mode[0])
    # `finish` asks the offload side too: nothing hosted here
    return SimpleNamespace(disagg=disagg, remote_control=SimpleNamespace(close=lambda scheduler: False), scheduler=None)


def main() -> None:
    role = sys.argv[1]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=f"[{role}] %(name)s: %(message)s")
    w = fake_worker(role)
    if role == "decode":
        reply = w.disagg.open_pair(KVPairOpen(rid="o", pairing=PAIRING, peer="p", peer_device="cpu",
                                              timeout_s=TIMEOUT_S))
        assert reply.ok, reply
        print(reply.data["store"], flush=True)
        receiver = w.disagg.receivers[PAIRING]
        while receiver.link is None:  # set once both ends have rendezvoused
            assert receiver.thread.is_alive(), "the pair failed"
            time.sleep(0.01)
        print("linked", flush=True)
    else:
        w.disagg.connect(KVPairConnect(pairing=PAIRING, peer="d", store=sys.argv[2], backend="gloo",
                                       timeout_s=TIMEOUT_S))
    if sys.stdin.readline().strip() == "linger":
        time.sleep(3600)
    finish(w, 0)
    print("finished", flush=True)


if __name__ == "__main__":
    main()
