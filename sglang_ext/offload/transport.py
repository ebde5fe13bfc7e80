"""Which data plane carries a pairing's q/k/v and outputs (`offload_transport`).

    local       the executor is in this process (`offload_executor`): calls, no messages
    torch_dist  a private two-rank torch.distributed group: gloo between CPU processes, NCCL between GPUs
    cuda_ipc    GPUs of one node: peer-mapped buffers and GPU-side signals (sglang_ext.offload.cuda_signal)

Nothing here imports torch: the router validates cluster files with it.
"""

from __future__ import annotations

import importlib.util
from typing import Final

SERVED_DEFAULT: Final = "torch_dist"  # a pairing across processes when none is asked for


def cuda_ipc_problem(device: str) -> str | None:
    """Why the cuda_ipc transport cannot serve a worker on `device` (None: it can)."""
    if not device.startswith("cuda"):
        return f"offload_transport cuda_ipc needs a GPU worker, this one runs on {device}"
    if importlib.util.find_spec("sglang_ext.offload.cuda_signal") is None:
        return "offload_transport cuda_ipc is not available in this build (no sglang_ext.offload.cuda_signal)"
    return None


def served_transport(asked: str | None) -> str:
    """The transport of a router-made pairing for a sender that asked for `asked`; ValueError
    when that cannot be served across processes."""
    if asked is None or asked == SERVED_DEFAULT:
        return SERVED_DEFAULT
    if asked == "local":
        raise ValueError("offload_transport local is the in-process executor (offload_executor); a pairing "
                         "from the cluster file's offload: runs across processes: use torch_dist or leave it unset")
    raise ValueError(f"offload_transport {asked} cannot serve a cluster-file pairing yet; use torch_dist")
