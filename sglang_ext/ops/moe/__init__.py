"""Mixture-of-Experts ops: torch references here, Triton kernels in `route`, `align`, `kernels`.

The kernel modules import Triton; `sglang_ext.ops` imports them lazily, on first CUDA use, so this
package (references and config lookup) stays importable on machines without Triton.
"""

from sglang_ext.ops.moe.configs import default_config, get_config
from sglang_ext.ops.moe.reference import fused_moe_ref, moe_route_ref

__all__ = ["default_config", "fused_moe_ref", "get_config", "moe_route_ref"]
