#!/usr/bin/env bash
# KV rotation end to end: one server per policy on the GPU, the KV budget small enough to bind,
# the same Azure-conversation workload at a high Poisson rate; SLO attainment and throughput per policy.
#   bash bench/rotation_e2e.sh [runs...]     (default: fcfs lvf wf sf; fcfs runs with recompute)
# A run is a policy, optionally with server flags after commas, e.g. the α / βF / B_xfer trade-offs:
#   bash bench/rotation_e2e.sh lvf,--lvf-alpha=1 lvf,--lvf-beta-tpot=0.25 lvf,--rotation-budget-mb=64
# Each run writes rot_<label>.json / .log / rot_metrics_<label>.txt / rot_server_<label>.log to OUT, where the
# label is the run with commas as "_", leading dashes dropped and "=" as "-" (lvf_lvf-alpha-1).
# Env: RATE (req/s, 24), N (requests, 600), TOKENS (device KV tokens, 65536), TTFT (s, 2), TBT (s, 0.1),
#      MODEL (preset:llama-3-8b), DEVICE (cuda), DTYPE (bfloat16), HOST_GB (32), TRACES, OUT (results folder). Needs the GPU machine's wheels on PYTHONPATH.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RATE=${RATE:-24}; N=${N:-600}; TOKENS=${TOKENS:-65536}; TTFT=${TTFT:-2}; TBT=${TBT:-0.1}
MODEL=${MODEL-preset:llama-3-8b}; PORT=${PORT:-31000}  # MODEL empty: the embedded default model
policies=${*:-fcfs lvf wf sf}
for run in $policies; do
  IFS=, read -r pol flags_csv <<< "$run,"
  flags=(); IFS=, read -r -a flags <<< "${flags_csv%,}"
  label=$(echo "$run" | sed 's/,--/_/g; s/,/_/g; s/=/-/g')
  mode=rotate; [ "$pol" = fcfs ] && mode=recompute
  extra=(); [ "$mode" = rotate ] && extra=(--kv-host-size-gb "${HOST_GB:-32}")
  model=(); [ -n "$MODEL" ] && model=(--model-path "$MODEL" --load-format dummy)
  python3 -m sglang_ext.launch ${model[@]+"${model[@]}"} --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bfloat16}" \
    --port "$PORT" --max-total-tokens "$TOKENS" --schedule-policy "$pol" --preemption-mode "$mode" \
    --ttft-slo-ms "$(python3 -c "print($TTFT*1000)")" --tpot-slo-ms "$(python3 -c "print($TBT*1000)")" \
    ${extra[@]+"${extra[@]}"} ${flags[@]+"${flags[@]}"} > "$OUT/rot_server_$label.log" 2>&1 &
  srv=$!
  for _ in $(seq 180); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" \
      > /dev/null 2>&1 && break
    kill -0 $srv 2>/dev/null || break
    sleep 1
  done
  timeout -s KILL 240 python3 bench/serving.py --trace azure-conv --num-requests "$N" --arrival poisson \
    --traces-dir "${TRACES:-bench/data/traces}" --request-rate "$RATE" --max-input-len 2048 --max-output-len 256 --ttft-slo "$TTFT" --tbt-slo "$TBT" --tbt-stat "${TBT_STAT:-mean}" \
    --vocab-size "${VOCAB:-32000}" --base-url "http://127.0.0.1:$PORT" --max-duration "${MAXDUR:-150}" --disable-tqdm \
    --output-json "$OUT/rot_$label.json" 2>&1 | tail -25 | tee "$OUT/rot_$label.log"
  python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$PORT/metrics').read().decode())" | grep -E "^sglang_ext:(kv_rot|rotary|kv_host|slo|num_preempt)" \
    > "$OUT/rot_metrics_$label.txt"
  kill -INT $srv; sleep 5; kill -9 $srv 2>/dev/null; wait $srv 2>/dev/null
done
