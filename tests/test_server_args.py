"""The CLI is derived from the `ServerArgs` dataclass: every field is a flag with help and its default."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import msgspec
import pytest

from router.config import ConfigError, load_cluster
from sglang_ext.server_args import ServerArgs


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    return p


def _flags(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in p._actions for s in a.option_strings}


def test_every_field_has_a_flag_with_help_and_default() -> None:
    flags = _flags(_parser())
    for f in dataclasses.fields(ServerArgs):
        action = flags.get("--" + f.name.replace("_", "-"))
        assert action is not None, f"no flag for {f.name}"
        assert action.dest == f.name
        assert action.help and "(default: " in action.help and not action.help.startswith("("), f.name


def test_defaults_round_trip() -> None:
    assert ServerArgs.from_cli(_parser().parse_args([])) == ServerArgs()


def test_flags_parse_to_typed_values() -> None:
    ns = _parser().parse_args([
        "--model-path", "preset:llama-3-8b", "--load-format", "dummy", "--skip-tokenizer-init",
        "--mem-fraction-static", "0.5", "--max-total-tokens", "4096", "--chunked-prefill-size", "-1",
        "--schedule-policy", "lpm", "--attention-backend", "torch", "--dtype", "bfloat16", "--port", "31000",
        "--disable-radix-cache", "--disable-cuda-graph", "--disable-overlap-schedule", "--api-key", "k",
    ])
    a = ServerArgs.from_cli(ns)
    assert a == ServerArgs(
        model_path="preset:llama-3-8b", load_format="dummy", skip_tokenizer_init=True, mem_fraction_static=0.5,
        max_total_tokens=4096, chunked_prefill_size=-1, schedule_policy="lpm", attention_backend="torch",
        dtype="bfloat16", port=31000, disable_radix_cache=True, disable_cuda_graph=True,
        disable_overlap_schedule=True, api_key="k",
    )


@pytest.mark.parametrize("argv", [["--dtype", "float8"], ["--schedule-policy", "lifo"],
                                  ["--attention-backend", "triton"], ["--max-total-tokens", "many"]])
def test_bad_flag_values_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(argv)
    assert e.value.code == 2 and argv[0] in capsys.readouterr().err


def test_keywords_are_the_field_names() -> None:
    assert ServerArgs.from_kwargs(max_total_tokens=8).max_total_tokens == 8
    with pytest.raises(TypeError, match="extra"):
        ServerArgs.from_kwargs(extra={})  # the dead `extra` field is gone


@pytest.mark.parametrize(("kw", "match"), [
    ({"offload_ratio": 1.5}, "offload_ratio"),
    ({"offload_ratio": -0.1}, "offload_ratio"),
    ({"executor_mem_gb": -1.0}, "executor_mem_gb"),
    ({"offload_executor": "gpu7", "offload_ratio": 0.5}, "offload_executor"),
    ({"offload_executor": "local"}, "offload_ratio is 0"),
])
def test_remote_attention_arguments_are_checked(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ServerArgs(**kw)


@pytest.mark.parametrize("window", [-1, 1025])
def test_sampling_top_k_window_is_checked(window: int) -> None:
    with pytest.raises(ValueError, match="sampling_top_k_window must be in \\[0, 1024\\]"):
        ServerArgs(sampling_top_k_window=window)
    assert ServerArgs.from_cli(_parser().parse_args(["--sampling-top-k-window", "0"])).sampling_top_k_window == 0
    assert ServerArgs().sampling_top_k_window == 256


def test_rotation_flags_parse() -> None:
    ns = _parser().parse_args([
        "--preemption-mode", "rotate", "--kv-host-size-gb", "2.5", "--schedule-policy", "lvf",
        "--ttft-slo-ms", "800", "--tpot-slo-ms", "40", "--lvf-alpha", "1", "--lvf-beta-ttft", "0.1",
        "--lvf-beta-tpot", "0.2", "--rotation-budget-mb", "64", "--disable-eager-rotation",
    ])
    a = ServerArgs.from_cli(ns)
    assert a == ServerArgs(preemption_mode="rotate", kv_host_size_gb=2.5, schedule_policy="lvf", ttft_slo_ms=800,
                           tpot_slo_ms=40, lvf_alpha=1, lvf_beta_ttft=0.1, lvf_beta_tpot=0.2,
                           rotation_budget_mb=64, disable_eager_rotation=True)
    assert (a.resolved_ttft_slo_s, a.resolved_tpot_slo_s, a.rotation_budget_bytes) == (0.8, 0.04, 64 << 20)
    assert (ServerArgs().resolved_ttft_slo_s, ServerArgs().resolved_tpot_slo_s) == (5.0, 0.1)
    for policy in ("wf", "sf"):
        assert ServerArgs(preemption_mode="rotate", schedule_policy=policy).schedule_policy == policy


@pytest.mark.parametrize(("kw", "message"), [
    ({"preemption_mode": "swap"}, "preemption_mode must be one of"),
    ({"schedule_policy": "lvf"}, "set preemption_mode to 'rotate'"),
    ({"schedule_policy": "wf"}, "set preemption_mode to 'rotate'"),
    ({"kv_host_size_gb": 4.0}, "kv_host_size_gb is set but preemption_mode is 'recompute'"),
    ({"preemption_mode": "rotate", "kv_host_size_gb": 0.0}, "kv_host_size_gb must be > 0"),
    ({"rotation_budget_mb": 0.0}, "rotation_budget_mb must be > 0"),
    ({"ttft_slo_ms": -5.0}, "ttft_slo_ms must be a positive"),
    ({"tpot_slo_ms": float("nan")}, "tpot_slo_ms must be a positive"),
    ({"lvf_alpha": 0.0}, "lvf_alpha must be > 0"),
    ({"lvf_beta_tpot": -0.1}, "lvf_beta_tpot must be >= 0"),
])
def test_rotation_arguments_checked_with_messages(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kw)  # type: ignore[arg-type]


def test_disaggregation_mode_flag() -> None:
    assert ServerArgs.from_cli(_parser().parse_args([])).disaggregation_mode is None
    ns = _parser().parse_args(["--disaggregation-mode", "prefill"])
    assert ServerArgs.from_cli(ns).disaggregation_mode == "prefill"
    with pytest.raises(SystemExit):
        _parser().parse_args(["--disaggregation-mode", "both"])


def test_diagnostics_flags_parse_and_cross_to_workers_as_json() -> None:
    ns = _parser().parse_args(["--step-log-interval-s", "5", "--profile-dir", "/tmp/prof",
                               "--profile-start-step", "100", "--profile-num-steps", "20"])
    a = ServerArgs.from_cli(ns)
    assert a == ServerArgs(step_log_interval_s=5.0, profile_dir="/tmp/prof", profile_start_step=100,
                           profile_num_steps=20)
    # what a worker process receives (sglang_ext.worker's ARGS_JSON)
    assert msgspec.json.decode(msgspec.json.encode(a), type=ServerArgs) == a
    off = ServerArgs.from_cli(_parser().parse_args([]))
    assert (off.step_log_interval_s, off.profile_dir) == (0.0, None)


def test_diagnostics_in_a_cluster_file_reach_each_worker(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("models:\n"
                   "  - name: a\n"
                   "    args: {step_log_interval_s: 5}\n"
                   "    workers: [{id: a-0}, {id: a-1, args: {profile_dir: /tmp/p, profile_start_step: 50}}]\n")
    w0, w1 = load_cluster(cfg).workers
    assert (w0.args.step_log_interval_s, w0.args.profile_dir) == (5.0, None)
    assert (w1.args.step_log_interval_s, w1.args.profile_dir, w1.args.profile_start_step) == (5.0, "/tmp/p", 50)
    cfg.write_text("models: [{name: a, args: {profile_num_steps: 5}}]\n")
    with pytest.raises(ConfigError, match=r"models\[0\].workers\[0\]: profile_start_step / profile_num_steps"):
        load_cluster(cfg)


def test_flags_to_kwargs_keeps_only_what_the_flags_set() -> None:
    """For tools that hand a run's launcher flags to an in-process engine or simulated scheduler."""
    assert ServerArgs.flags_to_kwargs([]) == {}
    assert ServerArgs.flags_to_kwargs(["--lvf-missed-last", "--schedule-policy=lvf"]) == {
        "lvf_missed_last": True, "schedule_policy": "lvf"}
    assert ServerArgs(**ServerArgs.flags_to_kwargs(["--lvf-missed-last"])).lvf_missed_last
