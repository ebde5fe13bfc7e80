#!/usr/bin/env bash
# Prefill/decode disaggregation end to end: a prefill worker on one GPU and a decode worker on
# another, served through the router; output throughput and SLO attainment with and without Adrenaline
# placement (the prefill worker's executor keeps a share of the requests' KV and runs their decode
# attention for the decode worker).
#   bash bench/pd_e2e.sh [runs...]        (default: pd fixed adrenaline)
# Runs: pd (no offload: entry), fixed (Adrenaline placement at RATIO), adrenaline (the adrenaline policy's
# bound), adaptive (steered by the prefill worker's P99 TTFT against TTFT).
# Each run writes pd_<run>.json / .log, pd_metrics_<run>.txt, pd_info_<run>.json, pd_router_<run>.log and
# pd_cluster_<run>.yaml to OUT.
# Env: RATE (req/s, 16), N (600), PREFILL_MEM / DECODE_MEM (each worker's mem_fraction_static of its GPU, 0.9:
#      the whole GPU, so no baseline runs starved; the executor's EXEC_GB comes out of the prefill worker's
#      share), PREFILL_TOKENS / DECODE_TOKENS (a pool of that many tokens instead, as the runs before
#      2026-12-02, whose defaults were 65536 / 32768),
#      EXEC_GB (executor memory the prefill worker offers, 32), RATIO (0.5; adaptive: the start), MAX_RATIO
#      (adaptive's max_ratio, 1.0), TTFT (s, 2), TBT (s, 0.1),
#      MAXDUR (s, 120), MODEL (preset:llama-3-8b; empty: the embedded model), PREFILL_DEV (cuda:0),
#      DECODE_DEV (cuda:1), DTYPE (bfloat16), MAX_IN (2048), MAX_OUT (256), TRACES, OUT, PORT (31200),
#      PREFILL_SM (empty; e.g. 60: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE for the prefill worker when both share a
#      GPU under MPS), BW_SHARE (0.5) and B_MAX (256): the adrenaline policy's bandwidth_share and b_max
#      (a prefill worker's GPU is compute-bound, so most of its HBM bandwidth is idle: try 0.8-1.0),
#      RESERVED_SMS (the prefill worker's executor_reserved_sms in the offloading runs; empty: none),
#      WORKER_ARGS (more server arguments for every worker, in YAML flow form, e.g. "step_log_interval_s: 5"),
#      RATES (a rate sweep on one cluster per run, fresh trace rows per rate, gp_pd-<run>_r<rate>.json for
#      `bench/goodput.py OUT`; unset: the single RATE), TRACE (azure-conv).
# On the two-GPU kind keep NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 set.
set -uo pipefail
source "$(dirname "$0")/cluster_run.sh"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RATE=${RATE:-16}; N=${N:-600}; TTFT=${TTFT:-2}; TBT=${TBT:-0.1}
MODEL=${MODEL-preset:llama-3-8b}; PORT=${PORT:-31200}
runs=${*:-pd fixed adrenaline}
ms() { python3 -c "print(int($1*1000))"; }
for run in $runs; do
  cfg="$OUT/pd_cluster_$run.yaml"
  fmt=""; [ -n "$MODEL" ] && fmt="load_format: dummy, dtype: ${DTYPE:-bfloat16}, "
  [ -n "${WORKER_ARGS:-}" ] && fmt="$fmt$WORKER_ARGS, "
  part=""; [ -n "${RESERVED_SMS:-}" ] && [ "$run" != pd ] && part=", executor_reserved_sms: $RESERVED_SMS"
  env=""; [ -n "${PREFILL_SM:-}" ] && env=", env: {CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: \"$PREFILL_SM\"}"
  {
    echo "router: {host: 127.0.0.1, port: $PORT, log_level: warning}"
    echo "models:"
    echo "  - name: m"
    [ -n "$MODEL" ] && echo "    model_path: $MODEL"
    echo "    args: {${fmt%, }}"
    echo "    slo: {ttft_ms: $(ms "$TTFT"), tpot_ms: $(ms "$TBT")}"
    echo "    workers:"
    ppool="mem_fraction_static: ${PREFILL_MEM:-0.9}"; [ -n "${PREFILL_TOKENS:-}" ] && ppool="max_total_tokens: $PREFILL_TOKENS"
    dpool="mem_fraction_static: ${DECODE_MEM:-0.9}"; [ -n "${DECODE_TOKENS:-}" ] && dpool="max_total_tokens: $DECODE_TOKENS"
    echo "      - {id: prefill-0, device: ${PREFILL_DEV:-cuda:0}, role: prefill, $ppool, args: {executor_mem_gb: ${EXEC_GB:-32}$part}$env}"
    echo "      - {id: decode-0, device: ${DECODE_DEV:-cuda:1}, role: decode, $dpool}"
    case $run in
      fixed) echo "offload: [{from: m, to: m, policy: fixed, ratio: ${RATIO:-0.5}}]" ;;
      adrenaline) echo "offload: [{from: m, to: m, policy: adrenaline, adrenaline: {bandwidth_share: ${BW_SHARE:-0.5}, b_max: ${B_MAX:-256}}}]" ;;
      adaptive) echo "offload: [{from: m, to: m, policy: adaptive, ratio: ${RATIO:-0.5}, max_ratio: ${MAX_RATIO:-1.0}}]" ;;
    esac
  } > "$cfg"
  cluster_up "$cfg" "$OUT/pd_router_$run.log" "$PORT"
  echo "== $run (ready=$READY)"
  offset=0
  for rate in ${RATES:-$RATE}; do
    out=pd_$run; n=$N
    if [ -n "${RATES:-}" ]; then out=gp_pd-${run}_r$rate; n=$(python3 -c "print(max(8, round($rate*${SECONDS_PER_RATE:-30})))"); fi
    timeout -s KILL $(( ${MAXDUR:-120} + 120 )) python3 bench/serving.py --trace "${TRACE:-azure-conv}" --num-requests "$n" \
      --trace-offset "$offset" --arrival "${ARRIVAL:-poisson}" ${RAMP_ARGS:-} --traces-dir "${TRACES:-bench/data/traces}" \
      --request-rate "$rate" --max-input-len "${MAX_IN:-2048}" --max-output-len "${MAX_OUT:-256}" --ttft-slo "$TTFT" \
      --tbt-slo "$TBT" --tbt-stat "${TBT_STAT:-mean}" --vocab-size "${VOCAB:-32000}" --base-url "http://127.0.0.1:$PORT" \
      --max-duration "${MAXDUR:-120}" --disable-tqdm --output-json "$OUT/$out.json" 2>&1 | tail -30 | tee "$OUT/$out.log"
    offset=$((offset + n))
  done
  cluster_scrape "$PORT" "^sglang_ext:(offload|offloaded|executor|slo|kv_transfer|disagg)" "$OUT/pd_metrics_$run.txt" "$OUT/pd_info_$run.json"
  cluster_down
done
