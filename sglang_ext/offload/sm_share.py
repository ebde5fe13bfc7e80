"""SMs a worker that hosts an attention executor keeps free of its own matmuls (`executor_sms`).

The executor's per-layer programs run on a high-priority stream of the host's GPU, but a kernel of the
host model that already holds every SM keeps them until its blocks retire: a decode GEMM streaming
a weight matrix is one wave of blocks that live as long as the kernel, so each of the executor's
kernels, 32 layers a step, may wait that long for an SM. Lowering cuBLASLt's SM count target by N
sizes the host's GEMM grids (the long kernels) for the other SMs, so the executor's kernels find N
SMs free at once; Adrenaline partitions SMs between prefill and the executor for the same reason.

The setting is process-wide and read when a matmul is issued (CUDA graphs keep what they were
captured with), so it is made before the model's graphs are captured. It applies to cuBLASLt, which
is made the preferred BLAS library here; the executor's attention (FlashInfer) is not a matmul and
keeps every SM.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def reserve_sms(count: int, device: torch.device) -> bool:
    """Keep `count` SMs of `device` free of this process's matmuls; False (logged) where it cannot."""
    if count <= 0 or device.type != "cuda":
        return False
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if setter is None:
        logger.warning("executor_sms=%d ignored: this torch (%s) has no cuBLAS SM carveout", count, torch.__version__)
        return False
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if count >= sms:
        raise ValueError(f"executor_sms={count} leaves no SM of the {sms} on {device} to the model")
    torch.backends.cuda.preferred_blas_library("cublaslt")
    setter(count)
    logger.info("matmuls on %s target %d of %d SMs: %d kept for the attention executor", device, sms - count, sms,
                count)
    return True
