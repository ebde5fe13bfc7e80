#!/usr/bin/env bash
# One device session for the two-GPU end-to-end runs on kind nvidia-h200-x2 (carry .whl-slim, or .whl where the tree leaves room):
#   bash bench/gpu_two_gpu.sh [exchange] [host] [contention] [gpu_tests] [served] [weaver] [ramp] [pd] [disagg_tests]
# exchange: the engine's per-layer exchange across the two GPUs (bench/remote_attention.py, lean = the engine's
# scheme); host: what hosting costs the host model with a real sender, the executor capped by HOST_SMS (0,8,16).
# gpu_tests: tests/test_gpu_offload.py (remote attention in-process, and with the model in an SM partition,
# executor_reserved_sms).
# contention: bench/remote_step.py (cuda_ipc, graphs) with the executor's GPU idle, busy with a cold model's
# decode-like load, and busy with that load kept off FREE_SMS SMs (16) (carveout, green context); CONTENTION_POINTS.
# served: the served offload tests on two GPUs (staged KV loads on); weaver: bench/weaver_e2e.sh with
# WEAVER_RUNS; ramp: fixed vs adaptive under a ServeGen rate ramp; pd: bench/pd_e2e.sh with PD_RUNS;
# disagg_tests: the served PD and Adrenaline tests on two GPUs. Everything lands in $OUT/r.tgz (the device
# tool returns one archive; names with '=' or many files do not come back). Each step's own env (RATE, N,
# ...) passes through; see the scripts' headers. Diagnostics for the workers of weaver, ramp and pd, as
# server arguments in WORKER_ARGS: "step_log_interval_s: 5" (a step profile line per worker every 5 s in
# the router logs), "profile_dir: /tmp/r/prof, profile_start_step: START, profile_num_steps: STEPS" (a
# torch.profiler window per worker, archived with the rest); and DUMP_STACKS=1 (every worker thread's
# stack into the log before each cluster stops).
# Results collect in /tmp/r: on a machine kept warm between calls, clear it first (rm -rf /tmp/r).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
R=/tmp/r; mkdir -p $R
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=$R bash bench/gpu_session.sh none > "$R/setup.log" 2>&1
export PYTHONPATH=$PWD:/tmp/site:/tmp/fi TRACES=${TRACES:-bench/data/traces}
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
for s in ${*:-served weaver}; do
  stamp "$s"
  case $s in
    contention)
      for v in off decode decode:carveout decode:green; do
        load=${v%%:*}; confine=${v#*:}; [ "$confine" = "$v" ] && confine=none
        stamp "contention $v"
        timeout -s KILL 150 python3 bench/remote_step.py --transport cuda_ipc --modes graph --steps 20 \
          --points "${CONTENTION_POINTS:-48:1024,96:1024}" --shares 0,0.5 --executor-load "$load" \
          --load-confine "$confine" --load-free-sms "${FREE_SMS:-16}" --out "$R/contention_${load}_$confine.json" \
          > "$R/contention_${load}_$confine.log" 2>&1
        grep -E '^\{' "$R/contention_${load}_$confine.log" || tail -5 "$R/contention_${load}_$confine.log"
      done ;;
    exchange) timeout -s KILL 240 python3 bench/remote_attention.py exchange --topologies two_gpu \
                --budget-s "${EXCHANGE_BUDGET_S:-90}" --out "$R/exchange.json" > "$R/exchange.log" 2>&1
              tail -12 "$R/exchange.log" ;;
    host) timeout -s KILL 240 python3 bench/remote_host.py --executor-sms "${HOST_SMS:-0,8,16}" \
            --out "$R/remote_host.json" > "$R/remote_host.log" 2>&1; tail -12 "$R/remote_host.log" ;;
    gpu_tests) timeout -s KILL 300 python3 -m pytest -q -rfs -p no:cacheprovider -o faulthandler_timeout=240 \
                 tests/test_gpu_offload.py 2>&1 | tail -25 > "$R/gpu_tests.log"; tail -3 "$R/gpu_tests.log" ;;
    served) SGLANG_EXT_TEST_DEVICE=cuda timeout -s KILL 200 python3 -m pytest -q -rfs -x \
              -p no:cacheprovider -o faulthandler_timeout=150 tests/test_offload_served.py 2>&1 | tail -25 > "$R/served.log"
            tail -3 "$R/served.log" ;;
    weaver) OUT=$R bash bench/weaver_e2e.sh ${WEAVER_RUNS:-fixed dedicated adaptive} 2>&1 \
              | grep -E "^==|model hot|model cold|Output token|Successful|Failed|TPOT \(|TTFT \(|<=" ;;
    ramp) OUT=$R/ramp ARRIVAL=ramp RAMP_ARGS=${RAMP_ARGS:---ramp-windows 144 --ramp-window-s 1} \
            bash bench/weaver_e2e.sh ${RAMP_RUNS:-fixed adaptive} 2>&1 | grep -E "^==|model |Output token|Failed|<=" ;;
    pd) OUT=$R bash bench/pd_e2e.sh ${PD_RUNS:-pd fixed adrenaline} 2>&1 \
          | grep -E "^==|Output token|Successful|Failed|TPOT \(|TTFT \(|<=" ;;
    disagg_tests) SGLANG_EXT_TEST_DEVICE=cuda timeout -s KILL 240 python3 -m pytest -q -rfs -x -p no:cacheprovider \
                    -o faulthandler_timeout=150 tests/test_disagg_served.py tests/test_adrenaline_served.py 2>&1 \
                    | tail -25 > "$R/disagg_tests.log"; tail -3 "$R/disagg_tests.log" ;;
  esac
  tar czf "$OUT/r.tgz" -C "$R" .  # after every step: a later step that runs past the limit loses nothing
done
stamp done
tar czf "$OUT/r.tgz" -C "$R" .
