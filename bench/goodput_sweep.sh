#!/usr/bin/env bash
# Goodput sweep on one GPU: one server per run at a stated share of the GPU's memory, a Poisson rate
# sweep against it, then bench/goodput.py (attainment of both SLOs per rate, goodput, a plot).
#   bash bench/goodput_sweep.sh [runs...]     (default: fcfs-recompute fcfs-rotate lvf-rotate)
# A run is POLICY-MODE (schedule policy, preemption mode). The pool is never chosen per mechanism:
# every run gets SHARE of the GPU (--mem-fraction-static: weights, activations and KV all fit in it;
# 0.25 = one of 4 models on the GPU, 1.0 is not allowed by the engine, use 0.9 for "whole GPU").
# Env: SHARE (0.25), RATES ("2 4 6" req/s), SECONDS (30: requests per point = rate x seconds),
#      TRACE (mooncake), MAX_IN (7680), MAX_OUT (256), TTFT (5 s), TPOT (0.1 s, mean per request),
#      MODEL (preset:llama-3-8b), HOST_GB (32, rotate runs), ARRIVAL (poisson, or burst: 4x the quiet
#      rate for 5 s of every 30 s, the same mean rate), TRACES, OUT. Reports: gp_<run>_r<rate>.json.
# One point per rate, fresh trace rows each: bench/goodput_knee.py is the method with repeats and bisection.
set -uo pipefail
# bash's own SECONDS counts up from the value in the environment (0 when none was given): read it first.
SECONDS_PER_POINT=$SECONDS; [ "$SECONDS_PER_POINT" -gt 0 ] || SECONDS_PER_POINT=30
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# Every report of this call carries one call id (bench/goodput.py says which calls a panel merges).
export SGLANG_EXT_CALL_ID=${SGLANG_EXT_CALL_ID:-sweep-$(date -u +%Y%m%dT%H%M%SZ)-$$}
SHARE=${SHARE:-0.25}; RATES=${RATES:-2 4 6}
TRACE=${TRACE:-mooncake}; MAX_IN=${MAX_IN:-7680}; MAX_OUT=${MAX_OUT:-256}; TTFT=${TTFT:-5}; TPOT=${TPOT:-0.1}
MODEL=${MODEL:-preset:llama-3-8b}; PORT=${PORT:-31000}
runs=${*:-fcfs-recompute fcfs-rotate lvf-rotate}
tag=""; [ "${ARRIVAL:-poisson}" != poisson ] && tag="-$ARRIVAL"  # burst reports: gp_<run>-burst_r<rate>.json
for run in $runs; do
  pol=${run%%-*}; mode=${run#*-}
  extra=(); [ "$mode" = rotate ] && extra=(--kv-host-size-gb "${HOST_GB:-32}")
  python3 -m sglang_ext.launch --model-path "$MODEL" --load-format dummy --device cuda --dtype bfloat16 \
    --port "$PORT" --mem-fraction-static "$SHARE" --schedule-policy "$pol" --preemption-mode "$mode" \
    --ttft-slo-ms "$(python3 -c "print($TTFT*1000)")" --tpot-slo-ms "$(python3 -c "print($TPOT*1000)")" \
    ${extra[@]+"${extra[@]}"} > "$OUT/gp_server_$run.log" 2>&1 &
  srv=$!
  for _ in $(seq 180); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" \
      > /dev/null 2>&1 && break
    kill -0 $srv 2>/dev/null || break
    sleep 1
  done
  offset=0  # each point replays fresh trace rows, so the prefix cache holds nothing of its prompts
  for rate in $RATES; do
    n=$(python3 -c "print(max(8, round($rate*$SECONDS_PER_POINT)))")
    timeout -s KILL $((SECONDS_PER_POINT * 3 + 60)) python3 bench/serving.py --trace "$TRACE" --num-requests "$n" \
      --trace-offset "$offset" --arrival "${ARRIVAL:-poisson}" --request-rate "$rate" --traces-dir "${TRACES:-bench/data/traces}" \
      --max-input-len "$MAX_IN" --max-output-len "$MAX_OUT" --ttft-slo "$TTFT" --tbt-slo "$TPOT" --tbt-stat mean \
      --vocab-size 32000 --base-url "http://127.0.0.1:$PORT" --max-duration $((SECONDS_PER_POINT * 3)) \
      --disable-tqdm --output-json "$OUT/gp_${run}${tag}_r${rate}.json" > "$OUT/gp_${run}${tag}_r${rate}.log" 2>&1
    offset=$((offset + n))
    echo "$run$tag rate $rate: $(grep -E 'Both SLOs|Request throughput' "$OUT/gp_${run}${tag}_r${rate}.log" | tr -s ' ' | tr '\n' ' ')"
  done
  python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$PORT/metrics').read().decode())" \
    | grep -E "^sglang_ext:(kv_rot|rotary|num_preempt)" > "$OUT/gp_metrics_$run$tag.txt"
  kill -INT $srv; sleep 5; kill -9 $srv 2>/dev/null; wait $srv 2>/dev/null
done
python3 bench/goodput.py "$OUT" --plot "$OUT/goodput.png" --out "$OUT/goodput.json"
