"""Which data plane carries a pairing's q/k/v and outputs (`offload_transport`).

    local       the executor is in this process (`offload_executor`): calls, no messages
    torch_dist  a private two-rank torch.distributed group: gloo between CPU processes, NCCL between GPUs
    cuda_ipc    GPUs of one node: peer-mapped buffers and GPU-side signals (sglang_ext.transport.cuda_signal);
                across processes its control messages (load, release, begin, close) go over a gloo pair

A served pairing (the cluster file's `offload:`) picks its transport from where its two workers run
(`WorkerSite`: each one's host name and device, as the router knows them) unless the sender forces one:

    sender asked   both GPUs on one node            otherwise
    (unset)        cuda_ipc, torch_dist where the   torch_dist
                   host finds no peer path
    cuda_ipc       cuda_ipc (an error, not a        error at pairing time
                   fallback, if it cannot work)
    torch_dist     torch_dist                       torch_dist

A sender started with `--offload-transport torch_dist` turns that automatic choice of cuda_ipc off
(the cross-process path has run on GPUs: tests/test_offload_served.py on two H200s, outputs equal to
no offload, and the executor's host killed mid-generation without a hang).

Nothing here imports torch: the router validates cluster files with it.
"""

from __future__ import annotations

import importlib.util
from typing import Final, NamedTuple

SERVED_DEFAULT: Final = "torch_dist"  # a pairing across processes when nothing better is known
SERVED: Final = ("torch_dist", "cuda_ipc")


class WorkerSite(NamedTuple):
    """Where a worker runs, as its WorkerInfo says: host name ("" from older workers) and device."""

    worker: str
    hostname: str
    device: str


class Choice(NamedTuple):
    transport: str
    fallback: str  # what the host serves instead when `transport` cannot work there ("": fail)


def cuda_ipc_problem(device: str) -> str | None:
    """Why the cuda_ipc transport cannot serve a worker on `device` (None: it can)."""
    if not device.startswith("cuda"):
        return f"offload_transport cuda_ipc needs a GPU worker, this one runs on {device}"
    if importlib.util.find_spec("sglang_ext.transport.cuda_signal") is None:
        return "offload_transport cuda_ipc is not available in this build (no sglang_ext.transport.cuda_signal)"
    return None


def check_served(asked: str | None) -> None:
    """ValueError when a sender that asked for `asked` cannot take part in a served pairing."""
    if asked is None or asked in SERVED:
        return
    if asked == "local":
        raise ValueError("offload_transport local is the in-process executor (offload_executor); a pairing "
                         "from the cluster file's offload: runs across processes: use torch_dist or cuda_ipc, "
                         "or leave it unset")
    raise ValueError(f"offload_transport {asked} cannot serve a cluster-file pairing; use torch_dist or cuda_ipc")


def same_node_gpus(a: WorkerSite, b: WorkerSite) -> str | None:
    """Why `a` and `b` cannot share memory with CUDA IPC (None: both are GPUs of one node)."""
    for w in (a, b):
        if not w.device.startswith("cuda"):
            return f"{w.worker} runs on {w.device}, not a GPU"
    if not a.hostname or not b.hostname:
        return "a worker does not report its host name"
    if a.hostname != b.hostname:
        return f"{a.worker} runs on {a.hostname} and {b.worker} on {b.hostname}"
    return None


def choose_transport(asked: str | None, sender: WorkerSite, host: WorkerSite) -> Choice:
    """The transport of a router-made pairing; ValueError when the one asked for cannot work."""
    check_served(asked)
    problem = same_node_gpus(sender, host)
    if asked == "cuda_ipc":
        if problem:
            raise ValueError(f"offload_transport cuda_ipc needs both workers on GPUs of one node: {problem}")
        return Choice("cuda_ipc", "")
    if asked is None and problem is None:
        return Choice("cuda_ipc", SERVED_DEFAULT)
    return Choice(SERVED_DEFAULT, "")
