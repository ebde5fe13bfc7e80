#!/usr/bin/env bash
# One device session for the GPU fast path (the run behind docs/benchmarks.md's GPU section).
# Needs the carried wheel folder .whl (bash bench/prepare_device.sh: the wheels and FlashInfer's kernels prebuilt,
# .whl/fi_so.tgz, so a fresh machine does not JIT them for ~10 min). Writes logs and JSON to $OUT.
#   bash bench/gpu_session.sh [test] [gputests] [serving] [bench] [cputests] [sampling] [offload] [ipc] [served]
#                             [structured] [rotation] [rotation_e2e] [gated] [goodput] [knee] [disagg] [routing] [host]
#                             [kneeseq]  (KNEE_SEQ="RUN:RATE[,RATE] ...": knee searches one after another in one call,
#                                         each into $OUT/knee-RUN-RATE[-RATE] with the time the call has left)
#                             [warm]  (compile and cache the JIT kernels before a timed step such as knee; the engine takes
#                                      WARM_FRACTION, else SHARE, else 0.25 of the GPU: a Mixtral needs 0.9)
#                             [moetests] [moetune] [moebench]  (issue 33: MoE kernels and models on one GPU)
#                                        (MOETESTS_K: a pytest -k expression, e.g. builds_every for the start-up build's test)
#                             [expertrecord]  (a dummy MoE's expert distribution under Mooncake: bench/expert_record.py)
#                             [samegpu]  (bench/remote_step.py with the executor in-process on the sender's own GPU)
#                             [setup]  (install only, then run a command of your own with
#                                       PYTHONPATH=$PWD:/tmp/site:/tmp/fi, as the session's c4 of 2026-12-06 did)
# On the two-GPU kind export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 first.
# served and the two-GPU cases of gputests need two GPUs (the executor sits on cuda:1).
# rotation_e2e replays the Azure conversation trace in bench/data/traces.
# structured needs the xgrammar wheel in .whl too (bash bench/fetch_wheels.sh .whl xgrammar==0.2.9), and reads a real
# vocabulary from a carried .vocab/mistral_common-*.whl (pip download --no-deps -d .vocab mistral_common==1.13.1).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
steps=${*:-test bench}
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$@"; }  # --upgrade: quiet on a warm machine
# FlashInfer and its runtime needs apart, so the torch-backend tests can run without it on the path.
# WHEELS: the carried wheel folder; .whl, else .whl-slim (bench/slim_wheels.py: the same without FlashInfer's JIT
# headers, for when the tree and .whl together pass the 64 MiB a call may carry)
W=${WHEELS:-$( [ -d .whl ] && echo .whl || echo .whl-slim )}
fi_whl=$(ls $W/*.whl | grep -E 'flashinfer|tvm_ffi|cuda_tile|cudnn_frontend')
pipi /tmp/fi $fi_whl || exit 1
pipi /tmp/site $(ls $W/*.whl | grep -v -E 'flashinfer|tvm_ffi|cuda_tile|cudnn_frontend') || exit 1
if [ -f $W/fi_so.tgz ]; then  # kernels built by an earlier run: load them as FlashInfer AOT modules
  mkdir -p /tmp/fi/flashinfer/data/aot && tar xzf $W/fi_so.tgz -C /tmp/fi/flashinfer/data/aot
fi
BASE=$PWD:/tmp/site
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv
# The knee search of bench/goodput_knee.py (docs/benchmarks.md, "Method") into $OUT/$1 ($1.log, $1.tgz), until
# KNEE_END_S seconds into this script (or for BUDGET_S): the knee and kneeseq steps.
knee_search() {
  local d=$1 budget=${BUDGET_S:-$(( ${KNEE_END_S:-560} - SECONDS ))} kv=() vs=() v snap
  if [ "${budget%.*}" -lt 30 ]; then echo "knee search $d: not started, ${budget} s left of the call"; return 0; fi
  # VARIANTS="NAME=ARGS;NAME=ARGS": one --variant each (runs POLICY-MODE.NAME in RUNS); SERVER_ARGS: --server-arg each
  IFS=';' read -ra vs <<< "${VARIANTS:-}"; for v in ${vs[@]+"${vs[@]}"}; do [ -n "$v" ] && kv+=(--variant "$v"); done
  for v in ${SERVER_ARGS:-}; do kv+=("--server-arg=$v"); done
  # $d.tgz after every point (knee.json is rewritten once a point's reports are written): a call the device
  # kills at its limit still brings back every finished point, for RESUME
  ( while sleep 10; do [ "$OUT/$d/knee.json" -nt "$OUT/$d.tgz" ] 2>/dev/null || continue
      (cd "$OUT" && tar czf "$d.tgz.part" "$d" 2>/dev/null && mv "$d.tgz.part" "$d.tgz"); done ) >/dev/null 2>&1 &
  snap=$!  # (its output not on the call's: a `sleep` left behind by the kill below would hold that open for 10 s)
  PYTHONPATH=$BASE:/tmp/fi timeout -s KILL $((${budget%.*} + 40)) python3 bench/goodput_knee.py \
    --runs ${RUNS:-fcfs-recompute lvf-rotate} --share "${SHARE:-0.25}" --trace "${TRACE:-mooncake}" \
    --arrival "${ARRIVAL:-poisson}" --ttft "${TTFT:-5}" --tpot "${TPOT:-0.1}" --grid ${GRID:-6 7 8} \
    --repeats "${REPEATS:-3}" --min-req "${MIN_REQ:-150}" --seconds "${SECONDS_PER_POINT:-30}" \
    --budget-s "$budget" --model "${MODEL:-preset:llama-3-8b}" --host-gb "${HOST_GB:-32}" \
    --max-in "${MAX_IN:-7680}" --max-out "${MAX_OUT:-256}" --traces-dir "${TRACES:-bench/data/traces}" \
    --step-log-s "${STEP_LOG_S:-2}" ${RESUME:+--resume "$RESUME"} ${FIRST_RUN:+--first "$FIRST_RUN"} ${EXTEND:+--extend "$EXTEND"} ${EST_START_S:+--est-start-s "$EST_START_S"} ${EST_OVERHEAD_S:+--est-overhead-s "$EST_OVERHEAD_S"} ${kv[@]+"${kv[@]}"} --out "$OUT/$d" 2>&1 \
    | tee "$OUT/$d.log"  # set SGLANG_EXT_COMMIT (+ SGLANG_EXT_DIRTY) where git is absent
  kill $snap 2>/dev/null; wait $snap 2>/dev/null; rm -f "$OUT/$d.tgz.part"
  PYTHONPATH=$BASE python3 bench/step_profile.py "$OUT/$d" > "$OUT/$d/steps.txt" 2>&1  # per point: step ms, KV use
  (cd "$OUT" && tar czf "$d.tgz" "$d")  # the device returns a limited number of files: the folder comes back whole in the archive
}
for s in $steps; do
  case $s in
    test) PYTHONPATH=$BASE:/tmp/fi timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_equivalence.py \
            2>&1 | tee "$OUT/gpu_test.log" ;;
    gputests) for i in $(seq ${GPUTESTS_REPEATS:-1}); do  # every single-GPU test file at once; issue 34 asks 3 in a row
            # one line per test with the clock: a run killed by its timeout still says which test was slow or hung
            # GPUTESTS_FIRST_TIMEOUT: the first run may also compile FlashInfer's JIT kernels on a fresh machine
            lim=${GPUTESTS_TIMEOUT:-560}; [ "$i" = 1 ] && lim=${GPUTESTS_FIRST_TIMEOUT:-$lim}
            PYTHONPATH=$BASE:/tmp/fi timeout $lim python3 -m pytest -v -rfs -p no:cacheprovider \
              tests/test_gpu_*.py 2>&1 | python3 -u -c "import sys, time; [print(time.strftime('%H:%M:%S'), l, end='') for l in sys.stdin]" \
              | tee "$OUT/gpu_tests_$i.log" | grep -E "FAILED|ERROR|passed|failed" | tail -25
          done ;;
    serving) PYTHONPATH=$BASE:/tmp/fi timeout 400 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_serving.py \
            2>&1 | tee "$OUT/gpu_serving.log" ;;
    bench) PYTHONPATH=$BASE:/tmp/fi timeout 360 python3 bench/offline.py --out "$OUT/offline.json" ${BENCH_ARGS:-} 2>&1 \
            | grep -v '^offline bench' | tee "$OUT/bench.log" ;;
    sampling) PYTHONPATH=$BASE:/tmp/fi timeout 300 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_sampling.py tests/test_window_pick.py \
            2>&1 | tee "$OUT/gpu_sampling_test.log"
          PYTHONPATH=$BASE:/tmp/fi timeout 300 python3 bench/sampling.py --out "$OUT/sampling.json" ${SAMPLING_ARGS:-} 2>&1 \
            | tee "$OUT/sampling.log" ;;
    structured) voc=(); v=$(ls .vocab/mistral_common-*.whl 2>/dev/null | head -1); [ -n "$v" ] && voc=(--vocab-file "$v")
          PYTHONPATH=$BASE:/tmp/fi timeout 500 python3 bench/structured.py --out "$OUT/structured.json" \
            ${voc[@]+"${voc[@]}"} ${STRUCTURED_ARGS:-} 2>&1 | tee "$OUT/structured.log" ;;
    rotation) PYTHONPATH=$BASE:/tmp/fi timeout 120 python3 -m pytest -q -rfs -p no:cacheprovider tests/test_gpu_rotation.py \
            2>&1 | tail -5 | tee "$OUT/gpu_rotation_test.log"
          PYTHONPATH=$BASE:/tmp/fi timeout 200 python3 bench/kv_rotation.py --out "$OUT/kv_rotation.json" \
            > "$OUT/kv_rotation.log" 2>&1; tail -8 "$OUT/kv_rotation.log" ;;
    rotation_e2e) PYTHONPATH=$BASE:/tmp/fi RATE=${RATE:-20} N=${N:-400} TOKENS=${TOKENS:-32768} MAXDUR=${MAXDUR:-80} \
            HOST_GB=${HOST_GB:-32} TRACES=${TRACES:-bench/data/traces} OUT="$OUT" timeout 580 bash bench/rotation_e2e.sh ${ROTATION_RUNS:-fcfs lvf wf sf} 2>&1 \
            | grep -E "Request throughput|TTFT \(|TPOT \(|<=|Both|Succ|Fail" ;;
    served) SGLANG_EXT_TEST_DEVICE=cuda PYTHONPATH=$BASE:/tmp/fi timeout 400 python3 -m pytest -q -rfs -x \
            -p no:cacheprovider tests/test_offload_served.py 2>&1 | tail -15 | tee "$OUT/gpu_offload_served.log" ;;
    host) PYTHONPATH=$BASE:/tmp/fi timeout ${HOST_TIMEOUT:-300} python3 bench/remote_host.py --executor-sms \
            ${HOST_SMS:-0,8,16,24,32} ${HOST_ARGS:-} --out "$OUT/remote_host.json" 2>&1 | tee "$OUT/remote_host.log" ;;
    gated) PYTHONPATH=$BASE:/tmp/fi timeout ${GATED_TIMEOUT:-560} python3 -m pytest -q -rfs -s -p no:cacheprovider \
            tests/test_gpu_gated_exchange.py tests/test_gpu_cuda_signal.py 2>&1 | tail -40 | tee "$OUT/gpu_gated.log" ;;
    offload) PYTHONPATH=$BASE:/tmp/fi timeout 300 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_offload.py \
            2>&1 | tee "$OUT/gpu_offload_test.log" ;;
    ipc) for lm in LAZY EAGER; do  # a hang is killed; EAGER module loading rules out lazy-load deadlocks
           CUDA_MODULE_LOADING=$lm PYTHONPATH=$BASE:/tmp/fi timeout -s KILL 200 python3 -m pytest -q -s -p no:cacheprovider \
             -o faulthandler_timeout=150 tests/test_gpu_offload.py -k cuda_ipc 2>&1 | tee "$OUT/gpu_ipc_$lm.log"
           [ "${PIPESTATUS[0]}" = 0 ] && break
         done
         CUDA_MODULE_LOADING=$lm PYTHONPATH=$BASE:/tmp/fi timeout -s KILL 300 python3 -X faulthandler bench/remote_step.py \
           --transport cuda_ipc --out "$OUT/remote_step_ipc.json" ${IPC_ARGS:-} 2>&1 | tee "$OUT/remote_step_ipc.log" ;;
    samegpu) PYTHONPATH=$BASE:/tmp/fi timeout ${SAMEGPU_TIMEOUT:-300} python3 bench/remote_step.py --executor-device cuda:0 \
            --executor-gb ${SAMEGPU_GB:-7} --points ${SAMEGPU_POINTS:-32:1024,64:1024,64:2048,128:2048} --shares 0,0.25,0.5 \
            --out "$OUT/remote_step_samegpu.json" 2>&1 | tee "$OUT/remote_step_samegpu.log" ;;  # the in-process executor on
          # the sender's own GPU (row 8's fixed/adaptive runs): the step the simulator would need to price them
    goodput) PYTHONPATH=$BASE:/tmp/fi OUT=$OUT/goodput timeout ${GOODPUT_TIMEOUT:-560} bash bench/goodput_sweep.sh \
            ${GOODPUT_RUNS:-} 2>&1 | tee "$OUT/goodput.log" ;;  # SHARE, RATES, SECONDS, TRACE, ARRIVAL, ...: goodput_sweep.sh
    warm) wa=(); for v in ${SERVER_ARGS:-}; do wa+=("--server-arg=$v"); done  # the runs' own flags: their kernels
          PYTHONPATH=$BASE:/tmp/fi timeout 300 python3 bench/warm.py --model "${MODEL:-preset:llama-3-8b}" \
            --mem-fraction "${WARM_FRACTION:-${SHARE:-0.25}}" ${wa[@]+"${wa[@]}"} 2>&1 | grep -E "^warm:|Error|error:" ;;  # every prefill bucket's JIT kernels, cached
    knee) knee_search knee ;;
    kneeseq) for item in ${KNEE_SEQ:-}; do  # "RUN:RATE[,RATE...] ...": one knee search each, one after another,
               # each given what the call has left (KNEE_END_S); the knee step's env otherwise (not RESUME: a grid each)
               if ! [[ $item =~ ^[A-Za-z0-9_.-]+:[0-9.]+(,[0-9.]+)*$ ]]; then
                 echo "kneeseq: '$item' is not RUN:RATE[,RATE...] (e.g. lvf-rotate:3.1875,3.375); skipped" >&2; continue
               fi
               RUNS=${item%%:*}; GRID=${item#*:}; GRID=${GRID//,/ }; RESUME= knee_search "knee-${item//[:,]/-}"
             done ;;
          # FIRST_RUN=RUN gives that run the call's first turn (a short call spent on the point that matters most).
          # EST_START_S / EST_OVERHEAD_S: the knee search's first guesses of a server start and a repeat's overhead
          # (60 / 15 s): a Qwen3-30B-A3B server took 12 s to start and warm, its repeats ~15 s past their arrivals (2026-12-07 s18)
          # EXTEND=0: no rates above the grid when it all passes (a call of one bisection point: without it a passing
          # point is followed by one at 1.5x, ~4 min of device time that cannot move the knee; 2026-12-07 session 13).
          # RESUME=DIR continues the search of an earlier call's knee folder (the same env otherwise; its points are not
          # rerun, its reports are copied to $OUT/knee). The device machine sees only what is sent: a call's $OUT comes back
          # here as files under /work/.device/N/, so put its knee/ in the tree before the next call, e.g. committed under
          # bench/results/<date>/, or copied to the ignored bench/results/tmp/knee-c1 and named in the run's carry
          # (64 MiB in all), then RESUME=bench/results/tmp/knee-c1: `bash bench/knee_carry.sh knee-c1` does that
          # from the newest call's files in a second (a warm machine waits ~30 s for the next call).
    disagg) for i in $(seq ${DISAGG_REPEATS:-3}); do  # the served PD failure tests (CPU workers), repeated: races show
            PYTHONPATH=$BASE timeout 300 python3 -m pytest -q -rfs -p no:cacheprovider tests/test_disagg_failures.py \
              2>&1 | tail -4 | tee "$OUT/disagg_failures_$i.log"
          done ;;
    routing) PYTHONPATH=$BASE:/tmp/fi timeout ${ROUTING_TIMEOUT:-560} python3 bench/routing.py \
            --policies ${ROUTING_POLICIES:-cache_aware,round_robin,shortest_queue} --sessions-from ${ROUTING_SESSIONS:-500} \
            --server-args "--model-path preset:llama-3-8b --load-format dummy --device cuda --dtype bfloat16 \
            --max-total-tokens ${ROUTING_TOKENS:-200000}" --out "$OUT/routing.json" -- --trace mooncake \
            --num-requests ${ROUTING_N:-141} --arrival poisson --request-rate ${ROUTING_RATE:-4} --ttft-slo 5 \
            --max-input-len 7680 --max-output-len 64 --vocab-size 32000 ${ROUTING_EXTRA:-} 2>&1 | tee "$OUT/routing.log" ;;
    moetests) PYTHONPATH=$BASE:/tmp/fi timeout ${MOETESTS_TIMEOUT:-400} python3 -m pytest -q -rfs -s -p no:cacheprovider \
            ${MOETESTS_K:+-k "$MOETESTS_K"} tests/test_moe_kernels.py tests/test_moe_warm.py tests/test_gpu_moe.py 2>&1 | tail -30 | tee "$OUT/gpu_moe_tests.log" ;;
    moetune) mkdir -p "$OUT/moe_configs"  # into the runtime's folder (a later moebench uses them) and $OUT: commit them
          for p in ${MOE_PRESETS:-mixtral-8x7b qwen3-30b-a3b}; do
            PYTHONPATH=$BASE timeout ${MOETUNE_TIMEOUT:-250} python3 bench/tune_moe.py --preset "$p" \
              ${MOETUNE_ARGS:-} 2>&1 | tail -25 | tee "$OUT/moe_tune_$p.log"
          done
          cp sglang_ext/ops/moe/configs/*.json "$OUT/moe_configs/" 2>/dev/null
          (cd "$OUT" && tar czf moe_configs.tgz moe_configs) ;;  # names with '=' and ',' do not come back as files
    moebench) for p in ${MOE_PRESETS:-mixtral-8x7b qwen3-30b-a3b}; do  # decode vs the experts-hit roofline, prefill, profile
            # MOE_BS / MOE_CTX: other decode batch sizes / contexts (e.g. the rows serving runs at: 4,8,12,16,24,32);
            # MOE_ROUTING="off uniform": one run each, the router's own choice and random routing as the serving runs
            # of dummy weights (--moe-routing-simulation), into offline-PRESET-ROUTING.json; MOE_SECTIONS: a subset
            # of decode,prefill,profile; MOE_ARGS: more bench/offline.py flags (e.g. --prefill-shapes 1x256,1x2048)
            case $p in mixtral*) kv=300000 ;; *) kv=600000 ;; esac  # what fits beside the weights on one H200
            for r in ${MOE_ROUTING:-off}; do
              f=offline-$p${MOE_ROUTING:+-$r}
              PYTHONPATH=$BASE:/tmp/fi timeout ${MOEBENCH_TIMEOUT:-280} python3 bench/offline.py --model-path "preset:$p" \
                --contexts ${MOE_CTX:-1024,8192} --batch-sizes ${MOE_BS:-1,8,32,64,128,256} --profile-ctx 2048,8192 \
                --max-kv-tokens ${MOE_KV_TOKENS:-$kv} --moe-routing-simulation "$r" \
                --sections ${MOE_SECTIONS:-decode,prefill,profile} ${MOE_ARGS:-} --out "$OUT/$f.json" 2>&1 | grep -v '^offline bench' \
                | tee "$OUT/$f.log"
            done
          done ;;
    expertrecord) port=${ER_PORT:-31990}  # a dummy MoE's own router recorded under Mooncake (issue 35: the skew
          # that bench/sim prices from a record; ER_MODEL, ER_ARGS e.g. --moe-routing-simulation uniform, ER_REQ, ER_RATE,
          # ER_OUT; ER_BENCH_ARGS: the workload instead of Mooncake, e.g. a decode-heavy one: "--trace synthetic
          # --synthetic-input-len 32 --synthetic-output-len 512 --synthetic-range-ratio 1" with ER_OUT=512)
          PYTHONPATH=$BASE:/tmp/fi python3 -m sglang_ext.launch --model-path "${ER_MODEL:-preset:qwen3-30b-a3b}" \
            --load-format dummy --mem-fraction-static "${SHARE:-0.9}" --expert-distribution-recorder-mode stat \
            --port "$port" ${ER_ARGS:-} > "$OUT/expert_server.log" 2>&1 &
          spid=$!
          PYTHONPATH=$BASE python3 -c "import sys, time, urllib.request
for _ in range(300):
    try:
        urllib.request.urlopen('http://127.0.0.1:$port/health_generate', timeout=5); sys.exit(0)
    except Exception: time.sleep(1)
sys.exit('server not up in 300 s')" || tail -20 "$OUT/expert_server.log"
          PYTHONPATH=$BASE:/tmp/fi timeout ${ER_TIMEOUT:-300} python3 bench/expert_record.py --out "$OUT/expert_record" \
            -- --base-url "http://127.0.0.1:$port" ${ER_BENCH_ARGS:---trace mooncake --max-input-len 7680} \
            --num-requests "${ER_REQ:-150}" --request-rate "${ER_RATE:-2}" --max-output-len "${ER_OUT:-256}" \
            --disable-tqdm 2>&1 \
            | tee "$OUT/expert_record.log"
          kill "$spid" 2>/dev/null; wait "$spid" 2>/dev/null ;;
    cputests) SGLANG_EXT_TEST_DEVICE=cuda PYTHONPATH=$BASE timeout 240 python3 -m pytest -q -p no:cacheprovider \
            --continue-on-collection-errors tests -k "engine or scheduler or models or overlap" 2>&1 | tee "$OUT/cpu_tests_on_cuda.log" ;;
    setup) ;;  # the wheels and kernels installed above, nothing run: for a command of one's own after it
    *) echo "gpu_session.sh: unknown step '$s' (nothing run for it; 'setup' installs only)" >&2 ;;
  esac
done
# The carried kernels plus the ones this call compiled, in one archive: a cache holding only the new ones
# made the next call compile the rest again (2026-12-03: the head-dim-128 prefill kernel, every call).
jit=$(ls -d ~/.cache/flashinfer/*/*/cached_ops 2>/dev/null | head -1)
if [ -n "$jit" ]; then
  mkdir -p /tmp/fi_all && cp -r /tmp/fi/flashinfer/data/aot/. /tmp/fi_all/ 2>/dev/null; cp -r "$jit"/. /tmp/fi_all/
  (cd /tmp/fi_all && tar czf "$OUT/fi_so.tgz" */*.so && ls -la "$OUT/fi_so.tgz")
fi
