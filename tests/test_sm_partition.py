"""`executor_reserved_sms` and `executor_max_sms`: the arguments' checks and the partitions' CPU
behaviour. Whether a green context's partition helps is measured on GPUs (bench/remote_step.py
--load-confine green, bench/remote_host.py --executor-sms); that a capped executor stays exact is
tests/test_gpu_gated_exchange.py. CUDA green contexts cannot be made on a CPU machine."""

import re

import pytest
import torch

from sglang_ext.engine import sm_partition
from sglang_ext.engine.model_runner import bind_device
from sglang_ext.server_args import ServerArgs


def test_negative_reserved_sms_are_rejected() -> None:
    with pytest.raises(ValueError, match="executor_reserved_sms"):
        ServerArgs(executor_reserved_sms=-1)


def test_negative_executor_cap_is_rejected() -> None:
    with pytest.raises(ValueError, match="executor_max_sms must be >= 0"):
        ServerArgs(executor_max_sms=-8)


def test_a_cap_and_a_reservation_together_are_rejected() -> None:
    """One keeps SMs for the executor, the other bounds it: together they ask for opposite things."""
    with pytest.raises(ValueError, match="set one"):
        ServerArgs(executor_max_sms=16, executor_reserved_sms=16)
    assert ServerArgs(executor_max_sms=16).executor_max_sms == 16


def test_no_partition_off_cuda() -> None:
    assert sm_partition.stream_for(torch.device("cpu")) is None
    assert sm_partition.executor_stream(torch.device("cpu")) is None
    sm_partition.enter(torch.device("cpu"))  # nothing to enter
    bind_device("cpu")


def test_a_cpu_engine_ignores_the_partition() -> None:
    """The argument only acts on a GPU that hosts an executor: a CPU worker with it starts as usual."""
    from sglang_ext.engine.model_runner import ModelRunner
    from sglang_ext.models.config import ModelConfig
    from sglang_ext.models.resolve import resolve_model_path

    for extra in ({"executor_reserved_sms": 16}, {"executor_max_sms": 16}):
        args = ServerArgs(device="cpu", executor_mem_gb=0.01, max_total_tokens=256, disable_cuda_graph=True,
                          **extra)
        model_dir = resolve_model_path(args.model_path)
        runner = ModelRunner(args, model_dir, ModelConfig.from_path(model_dir))
        assert runner.device.type == "cpu" and not sm_partition._streams and not sm_partition._exec_ctx


def test_a_cluster_file_takes_the_cap_and_refuses_both(tmp_path) -> None:
    """`executor_max_sms` is a worker argument in a cluster file like any other; with the reservation the
    cluster does not start, and the error says where."""
    from router.config import ConfigError, load_cluster

    cfg = tmp_path / "c.yaml"
    cfg.write_text("models: [{name: cold, args: {executor_mem_gb: 8, executor_max_sms: 8}}]")
    assert [w.args.executor_max_sms for w in load_cluster(cfg).workers] == [8]
    cfg.write_text("models: [{name: cold, args: {executor_mem_gb: 8, executor_max_sms: 8, executor_reserved_sms: 8}}]")
    where = re.escape("models[0].workers[0]: executor_max_sms and executor_reserved_sms")
    with pytest.raises(ConfigError, match=where + ".*: set one"):
        load_cluster(cfg)
