"""`executor_sms`: the server argument's checks and the carveout helper's CPU behaviour (the GPU effect
is measured by bench/remote_step.py --load-confine carveout, docs/benchmarks.md)."""

import pytest
import torch

from sglang_ext.offload.sm_share import reserve_sms
from sglang_ext.server_args import ServerArgs


def test_negative_executor_sms_is_rejected() -> None:
    with pytest.raises(ValueError, match="executor_sms"):
        ServerArgs(executor_sms=-1)


def test_no_carveout_off_cuda_or_at_zero() -> None:
    before = torch._C._get_sm_carveout_experimental()
    assert reserve_sms(16, torch.device("cpu")) is False
    assert reserve_sms(0, torch.device("cuda:0")) is False
    assert torch._C._get_sm_carveout_experimental() == before
