#!/usr/bin/env bash
# WEAVER end to end: a hot model whose KV binds on one GPU and a cold model on a second GPU,
# served through the router with a skewed two-model load; the hot model's throughput and SLO attainment
# and the cold model's TPOT, dedicated (no offload) vs offloading a share of the hot model's decode
# attention and KV to an executor the cold worker hosts.
#   bash bench/weaver_e2e.sh [runs...]        (default: dedicated fixed adaptive)
# Runs: dedicated (no offload: entry), fixed (policy fixed, RATIO), adaptive (policy adaptive, starting at
# RATIO, bounded by MAX_RATIO, steered by the cold model's P99 TPOT against TBT).
# Each run writes weaver_<run>.json / .log, weaver_metrics_<run>.txt, weaver_info_<run>.json,
# weaver_router_<run>.log and weaver_cluster_<run>.yaml to OUT.
# Env: RATE (total req/s, 16), N (requests, 600), HOT_SHARE (0.9), HOT_MEM / COLD_MEM (each worker's
#      mem_fraction_static of its GPU, 0.9: the whole GPU, so no baseline runs starved; the executor's EXEC_GB
#      comes out of the cold worker's share), HOT_TOKENS / COLD_TOKENS (a pool of that many tokens instead,
#      as the runs before 2026-12-02, whose defaults were 32768 / 65536), EXEC_GB (executor memory the cold worker offers, 32), RATIO (0.45),
#      MAX_RATIO (0.6), TTFT (s, 2), TBT (s, 0.1), MAXDUR (s, 120), MODEL (preset:llama-3-8b; empty: the
#      embedded model), HOT_DEV (cuda:0), COLD_DEV (cuda:1), DTYPE (bfloat16), TRACES, OUT, PORT (31100),
#      ARRIVAL (poisson | ramp: RATE is then the peak of a ServeGen rate series, shaped by RAMP_ARGS, e.g.
#      "--ramp-windows 144 --ramp-window-s 1": a day in 144 s), RESERVED_SMS (the cold worker's
#      executor_reserved_sms in the offloading runs: its model runs on the other SMs; empty: none), MAX_SMS
#      (the cold worker's executor_max_sms in the offloading runs: the executor on that many SMs), WORKER_ARGS
#      (more server arguments for every worker, in YAML flow form, e.g. "step_log_interval_s: 5"),
#      RATES (a rate sweep on one cluster per run: each rate replays fresh trace rows and writes
#      gp_weaver-<run>_r<rate>.json, for `bench/goodput.py OUT --model hot`; unset: the single RATE). Plot the
#      runs' SLO attainment over time with
#      python bench/plot_slo_timeline.py fixed=OUT/weaver_fixed.json adaptive=OUT/weaver_adaptive.json
# On the two-GPU kind keep NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 set.
set -uo pipefail
source "$(dirname "$0")/cluster_run.sh"
# cuda_ipc pairings load KV GPU to GPU through the host's stage (the default; set
# --disable-ipc-staged-loads on the executor host for the gloo loads of the first runs).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RATE=${RATE:-16}; N=${N:-600}; HOT_SHARE=${HOT_SHARE:-0.9}; TTFT=${TTFT:-2}; TBT=${TBT:-0.1}
MODEL=${MODEL-preset:llama-3-8b}; PORT=${PORT:-31100}
runs=${*:-dedicated fixed adaptive}
ms() { python3 -c "print(int($1*1000))"; }
for run in $runs; do
  cfg="$OUT/weaver_cluster_$run.yaml"
  path=""; fmt=""
  if [ -n "$MODEL" ]; then path="    model_path: $MODEL"; fmt="load_format: dummy, dtype: ${DTYPE:-bfloat16}, "; fi
  [ -n "${WORKER_ARGS:-}" ] && fmt="$fmt$WORKER_ARGS, "
  {
    echo "router: {host: 127.0.0.1, port: $PORT, log_level: warning}"
    echo "models:"
    echo "  - name: hot"
    [ -n "$path" ] && echo "$path"
    hot_pool="mem_fraction_static: ${HOT_MEM:-0.9}"; [ -n "${HOT_TOKENS:-}" ] && hot_pool="max_total_tokens: $HOT_TOKENS"
    cold_pool="mem_fraction_static: ${COLD_MEM:-0.9}"; [ -n "${COLD_TOKENS:-}" ] && cold_pool="max_total_tokens: $COLD_TOKENS"
    echo "    args: {${fmt}$hot_pool}"
    echo "    slo: {ttft_ms: $(ms "$TTFT"), tpot_ms: $(ms "$TBT")}"
    echo "    workers: [{id: hot-0, device: ${HOT_DEV:-cuda:0}, role: hot}]"
    echo "  - name: cold"
    [ -n "$path" ] && echo "$path"
    part=""; [ -n "${RESERVED_SMS:-}" ] && [ "$run" != dedicated ] && part=", executor_reserved_sms: $RESERVED_SMS"
    [ -n "${MAX_SMS:-}" ] && [ "$run" != dedicated ] && part="$part, executor_max_sms: $MAX_SMS"
    echo "    args: {${fmt}$cold_pool, executor_mem_gb: ${EXEC_GB:-32}$part}"
    echo "    slo: {ttft_ms: $(ms "$TTFT"), tpot_ms: $(ms "$TBT")}"
    echo "    workers: [{id: cold-0, device: ${COLD_DEV:-cuda:1}, role: cold}]"
    case $run in
      fixed) echo "offload: [{from: hot, to: cold, policy: fixed, ratio: ${RATIO:-0.45}}]" ;;
      adaptive) echo "offload: [{from: hot, to: cold, policy: adaptive, ratio: ${RATIO:-0.45}, max_ratio: ${MAX_RATIO:-0.6}}]" ;;
    esac
  } > "$cfg"
  cluster_up "$cfg" "$OUT/weaver_router_$run.log" "$PORT"
  echo "== $run (ready=$READY)"
  offset=0
  for rate in ${RATES:-$RATE}; do
    out=weaver_$run; n=$N
    if [ -n "${RATES:-}" ]; then out=gp_weaver-${run}_r$rate; n=$(python3 -c "print(max(8, round($rate*${SECONDS_PER_RATE:-30})))"); fi
    timeout -s KILL $(( ${MAXDUR:-120} + 120 )) python3 bench/serving.py --trace "${TRACE:-azure-conv}" --num-requests "$n" \
      --trace-offset "$offset" --arrival "${ARRIVAL:-poisson}" ${RAMP_ARGS:-} \
      --traces-dir "${TRACES:-bench/data/traces}" --request-rate "$rate" --models hot,cold \
      --model-weights "$HOT_SHARE,$(python3 -c "print(round(1-$HOT_SHARE, 6))")" \
      --max-input-len "${MAX_IN:-2048}" --max-output-len "${MAX_OUT:-256}" --ttft-slo "$TTFT" --tbt-slo "$TBT" \
      --tbt-stat "${TBT_STAT:-mean}" --vocab-size "${VOCAB:-32000}" --base-url "http://127.0.0.1:$PORT" \
      --max-duration "${MAXDUR:-120}" --disable-tqdm --output-json "$OUT/$out.json" 2>&1 \
      | tail -60 | tee "$OUT/$out.log"
    offset=$((offset + n))
  done
  cluster_scrape "$PORT" "^sglang_ext:(offload|offloaded|executor|slo|num_running|kv_used)" "$OUT/weaver_metrics_$run.txt" "$OUT/weaver_info_$run.json"
  cluster_down
done
