# Shared by the router end-to-end scripts (weaver_e2e.sh, pd_e2e.sh): source it, then
#   cluster_up CLUSTER.yaml LOG PORT     start `python -m sglang_ext.launch --config`; sets SRV (its pid) and
#                                        READY (1 once every worker is up and every pairing active)
#   cluster_scrape PORT REGEX METRICS INFO   the router's /metrics lines matching REGEX, and /get_server_info
#   cluster_down                         stop the launcher and any worker it left behind (DUMP_STACKS=1:
#                                        first every worker thread's stack into the launcher's log)
cluster_up() {
  python3 -m sglang_ext.launch --config "$1" > "$2" 2>&1 &
  SRV=$!
  READY=0
  for _ in $(seq 300); do
    if python3 - "$3" <<'PY' 2>/dev/null; then READY=1; break; fi
import json, sys, urllib.request
info = json.load(urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/get_server_info", timeout=2))
workers = [w for m in info["models"].values() for w in m["workers"]]
assert workers and all(w["up"] for w in workers)
assert all(p["state"] == "active" for p in info["offload"])  # [] without an offload entry
pairs = info.get("disaggregation") or []
assert all(p["state"] == "active" for p in pairs)
assert pairs or not any(w["role"] == "prefill" for w in workers)  # a PD model serves once a pair is open
PY
    kill -0 "$SRV" 2>/dev/null || break
    sleep 1
  done
}

cluster_scrape() {
  python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$1/metrics').read().decode())" \
    | grep -E "$2" > "$3"
  python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$1/get_server_info').read().decode())" \
    > "$4"
}

cluster_down() {
  if [ "${DUMP_STACKS:-0}" = 1 ]; then  # every worker thread's stack into the log (faulthandler, SIGUSR1)
    pkill -USR1 -f "sglang_ext.worker" 2>/dev/null; sleep 2
  fi
  kill -INT "$SRV"; sleep 8; kill -9 "$SRV" 2>/dev/null; wait "$SRV" 2>/dev/null
  pkill -9 -f "sglang_ext.worker" 2>/dev/null; sleep 1
}
