"""`executor_reserved_sms`: the argument's checks and the partition's CPU behaviour. Whether a green
context's partition helps the executor is measured on GPUs (bench/remote_step.py --load-confine green);
CUDA green contexts cannot be made on a CPU machine."""

import pytest
import torch

from sglang_ext.engine import sm_partition
from sglang_ext.engine.model_runner import bind_device
from sglang_ext.server_args import ServerArgs


def test_negative_reserved_sms_are_rejected() -> None:
    with pytest.raises(ValueError, match="executor_reserved_sms"):
        ServerArgs(executor_reserved_sms=-1)


def test_no_partition_off_cuda() -> None:
    assert sm_partition.stream_for(torch.device("cpu")) is None
    sm_partition.enter(torch.device("cpu"))  # nothing to enter
    bind_device("cpu")


def test_a_cpu_engine_ignores_the_partition() -> None:
    """The argument only acts on a GPU that hosts an executor: a CPU worker with it starts as usual."""
    from sglang_ext.engine.model_runner import ModelRunner
    from sglang_ext.models.config import ModelConfig
    from sglang_ext.models.resolve import resolve_model_path

    args = ServerArgs(device="cpu", executor_mem_gb=0.01, executor_reserved_sms=16, max_total_tokens=256,
                      disable_cuda_graph=True)
    model_dir = resolve_model_path(args.model_path)
    runner = ModelRunner(args, model_dir, ModelConfig.from_path(model_dir))
    assert runner.device.type == "cpu" and not sm_partition._streams
