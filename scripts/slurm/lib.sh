# shellcheck shell=bash
# Shared by rollout.sbatch and train.sbatch (sourced; not a job script). Starts rollout-serve on a set
# of nodes with srun, waits for /health on all of them, writes the server list, and cleans up.
# Every knob is an environment variable with a default; see the usage comment of rollout.sbatch.

: "${ROLLOUT_PYTHON:=python}"                  # interpreter with the project installed
: "${ROLLOUT_SERVE:=rollout-serve}"            # the server command, split on spaces (e.g. "python -m rollout.server")
: "${ROLLOUT_ENGINE_CONFIG:=}"                 # configs/engine/<name>.yaml -> rollout-serve flags
: "${ROLLOUT_SERVE_ARGS=--enable-return-routed-experts}"    # extra rollout-serve flags (after the config's; may be empty)
: "${ROLLOUT_SERVERS_PER_NODE:=1}"             # one server per node, or one per DP group of GPUs
: "${ROLLOUT_GPUS_PER_SERVER:=}"               # set with SERVERS_PER_NODE>1: CUDA_VISIBLE_DEVICES slice per server
: "${ROLLOUT_NODES_PER_SERVER:=1}"             # nodes one server spans (--nnodes); its --dp-size counts them all
: "${ROLLOUT_SRUN_ARGS:=}"                    # extra srun flags for the server step (e.g. --gpus-per-task=4)
: "${ROLLOUT_BIND_HOST:=0.0.0.0}"              # the servers' bind address (reached by node name)
: "${ROLLOUT_API_KEY:=}"                       # passed as --api-key when set
: "${ROLLOUT_ADMIN_API_KEY:=}"                 # passed as --admin-api-key when set
: "${ROLLOUT_HEALTH_TIMEOUT:=900}"             # seconds to wait for every /health
: "${ROLLOUT_MAX_RESTARTS:=20}"                # times a server that exited on its own is restarted
: "${ROLLOUT_STOP_TIMEOUT:=30}"                # seconds between SIGTERM and SIGKILL at cleanup
: "${ROLLOUT_JOB_DIR:=${SLURM_SUBMIT_DIR:-$PWD}/rollout-job-${SLURM_JOB_ID:-local}}"   # logs + server list
: "${ROLLOUT_SERVERS_FILE:=$ROLLOUT_JOB_DIR/servers.txt}"   # one http://node:port per line

_ROLLOUT_STEP_PIDS=()    # every background child to stop at exit
_ROLLOUT_SRUN_PIDS=()    # the srun ones among them (their tasks are signalled through scancel)

rollout_track() { _ROLLOUT_STEP_PIDS+=("$1"); [ "${2:-}" = srun ] && _ROLLOUT_SRUN_PIDS+=("$1"); return 0; }

rollout_log() { echo "[$(date -u +%H:%M:%S) ${SLURM_JOB_ID:-local}] $*"; }

rollout_cleanup() {
    # Stops every process this script started: SIGTERM first, SIGKILL for what is left after
    # ROLLOUT_STOP_TIMEOUT seconds. Idempotent; runs from the EXIT trap.
    local pid alive deadline
    [ "${#_ROLLOUT_STEP_PIDS[@]}" -eq 0 ] && return 0
    rollout_log "cleanup: stopping ${#_ROLLOUT_STEP_PIDS[@]} step(s)"
    # SIGTERM reaches the steps' tasks (rollout-serve, the trainer) through scancel, so that they shut
    # down cleanly; signalling srun itself would make it force-kill the step. Non-srun children
    # (a client command) get SIGTERM directly.
    if [ -n "${SLURM_JOB_ID:-}" ] && [ "${#_ROLLOUT_SRUN_PIDS[@]}" -gt 0 ]; then
        scancel --quiet --signal=TERM "$SLURM_JOB_ID" 2>/dev/null || true
    fi
    for pid in "${_ROLLOUT_STEP_PIDS[@]}"; do
        case " ${_ROLLOUT_SRUN_PIDS[*]} " in *" $pid "*) ;; *) kill -TERM "$pid" 2>/dev/null || true ;; esac
    done
    deadline=$((SECONDS + ROLLOUT_STOP_TIMEOUT))
    while :; do
        alive=0
        for pid in "${_ROLLOUT_STEP_PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ "$alive" -eq 0 ] && break
        if [ "$SECONDS" -ge "$deadline" ]; then
            rollout_log "cleanup: steps still alive after ${ROLLOUT_STOP_TIMEOUT}s, SIGKILL"
            for pid in "${_ROLLOUT_STEP_PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
            rollout_kill_steps
            break
        fi
        sleep 0.5
    done
    for pid in "${_ROLLOUT_STEP_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    _ROLLOUT_STEP_PIDS=(); _ROLLOUT_SRUN_PIDS=()
    rollout_log "cleanup: done"
}

rollout_kill_steps() {  # SIGKILL to the job's srun steps (never the batch step running this script)
    local step
    [ -n "${SLURM_JOB_ID:-}" ] || return 0
    for step in $(squeue --steps --noheader --jobs "$SLURM_JOB_ID" --format=%i 2>/dev/null); do
        case "$step" in *.batch|*.extern) ;; *) scancel --quiet --signal=KILL "$step" 2>/dev/null || true ;; esac
    done
}

rollout_install_traps() {
    trap rollout_cleanup EXIT
    trap 'rollout_log "caught SIGTERM"; exit 143' TERM
    trap 'rollout_log "caught SIGINT"; exit 130' INT
    trap 'rollout_log "caught SIGHUP"; exit 129' HUP
}

rollout_node_addr() {  # rollout_node_addr NODE -> the address SLURM reaches NODE at (NodeAddr; defaults to its name)
    local addr
    addr=$(scontrol show node -o "$1" 2>/dev/null | tr ' ' '\n' | sed -n 's/^NodeAddr=//p')
    echo "${addr:-$1}"
}

rollout_http_ok() {  # rollout_http_ok URL -> 0 when GET URL answers 200
    "$ROLLOUT_PYTHON" -c 'import sys, urllib.request
try:
    sys.exit(0 if urllib.request.urlopen(sys.argv[1], timeout=5).status == 200 else 1)
except Exception:
    sys.exit(1)' "$1"
}

# rollout_start_servers NODELIST: one srun step, ROLLOUT_SERVERS_PER_NODE tasks per node, each a
# rollout-serve on a free port (--port 0: the server binds, then prints its port; no race). With
# ROLLOUT_NODES_PER_SERVER=N > 1, every N consecutive nodes run one server (--nnodes N): the first
# of them (--node-rank 0) serves HTTP and hosts the rendezvous at its NodeAddr on a port it picks,
# written to $ROLLOUT_JOB_DIR/dist-<server>.addr, which the others read (--dist-init-addr).
rollout_start_servers() {
    local nodelist=$1 nnodes flags=() config_flags serve_cmd=() per=$ROLLOUT_NODES_PER_SERVER addrs="" node
    read -r -a serve_cmd <<< "$ROLLOUT_SERVE"
    nnodes=$(scontrol show hostnames "$nodelist" | wc -l)
    if [ "$per" -lt 1 ] || [ $((nnodes % per)) -ne 0 ] || { [ "$per" -gt 1 ] && [ "$ROLLOUT_SERVERS_PER_NODE" -ne 1 ]; }; then
        rollout_log "error: ROLLOUT_NODES_PER_SERVER=$per must divide the $nnodes server node(s)" \
                    "(and needs ROLLOUT_SERVERS_PER_NODE=1, got $ROLLOUT_SERVERS_PER_NODE)"
        return 1
    fi
    if [ "$per" -gt 1 ]; then
        for node in $(scontrol show hostnames "$nodelist"); do addrs+="$(rollout_node_addr "$node") "; done
    fi
    mkdir -p "$ROLLOUT_JOB_DIR"
    rm -f "$ROLLOUT_JOB_DIR"/server-*.log "$ROLLOUT_JOB_DIR"/dist-*.addr "$ROLLOUT_SERVERS_FILE"
    if [ -n "$ROLLOUT_ENGINE_CONFIG" ]; then
        config_flags=$("$ROLLOUT_PYTHON" -W ignore -m rollout.config --flags "$ROLLOUT_ENGINE_CONFIG") || return 1
        eval "flags=($config_flags)"
    fi
    # shellcheck disable=SC2206
    flags+=($ROLLOUT_SERVE_ARGS --host "$ROLLOUT_BIND_HOST")
    [ -n "$ROLLOUT_API_KEY" ] && flags+=(--api-key "$ROLLOUT_API_KEY")
    [ -n "$ROLLOUT_ADMIN_API_KEY" ] && flags+=(--admin-api-key "$ROLLOUT_ADMIN_API_KEY")
    rollout_log "starting $ROLLOUT_SERVERS_PER_NODE server(s) per node on $nodelist" \
                "$([ "$per" -gt 1 ] && echo "($per nodes per server)"): ${serve_cmd[*]} ${flags[*]}"
    # Each task: pick its GPU slice (when asked), then run the server; a server that exits on its
    # own (rollout-serve exits non-zero when its engine dies) is started again on the port it had,
    # so the trainer's server list stays valid (an engine-only node of a server that spans nodes is
    # started again whenever it ends, to rejoin its restarted node 0). SIGTERM/SIGINT end the task
    # (and its server).
    # shellcheck disable=SC2086
    srun $ROLLOUT_SRUN_ARGS --nodes="$nnodes" --nodelist="$nodelist" --ntasks-per-node="$ROLLOUT_SERVERS_PER_NODE" \
         --ntasks=$((nnodes * ROLLOUT_SERVERS_PER_NODE)) --overlap --kill-on-bad-exit=0 \
         --output="$ROLLOUT_JOB_DIR/server-%t.log" --error="$ROLLOUT_JOB_DIR/server-%t.log" \
         env ROLLOUT_JOB_DIR="$ROLLOUT_JOB_DIR" ROLLOUT_MAX_RESTARTS="$ROLLOUT_MAX_RESTARTS" \
             ROLLOUT_GPUS_PER_SERVER="${ROLLOUT_GPUS_PER_SERVER:-}" ROLLOUT_NODES_PER_SERVER="$per" \
             ROLLOUT_NODE_ADDRS="$addrs" ROLLOUT_PYTHON="$ROLLOUT_PYTHON" \
         bash -c 'if [ -n "$ROLLOUT_GPUS_PER_SERVER" ]; then
                      first=$((SLURM_LOCALID * ROLLOUT_GPUS_PER_SERVER))
                      CUDA_VISIBLE_DEVICES=$(seq -s, "$first" $((first + ROLLOUT_GPUS_PER_SERVER - 1)))
                      export CUDA_VISIBLE_DEVICES
                  fi
                  node_rank=0; node_flags=()
                  if [ "$ROLLOUT_NODES_PER_SERVER" -gt 1 ]; then
                      read -r -a addrs <<< "$ROLLOUT_NODE_ADDRS"
                      server=$((SLURM_PROCID / ROLLOUT_NODES_PER_SERVER)); node_rank=$((SLURM_PROCID % ROLLOUT_NODES_PER_SERVER))
                      dist="$ROLLOUT_JOB_DIR/dist-$server.addr"
                      if [ "$node_rank" = 0 ]; then
                          head=${addrs[$SLURM_PROCID]}; case "$head" in *:*) head="[$head]" ;; esac
                          port=$("$ROLLOUT_PYTHON" -c "import socket; s = socket.socket(); s.bind((\"\", 0)); print(s.getsockname()[1])")
                          echo "$head:$port" > "$dist.tmp" && mv "$dist.tmp" "$dist"
                      fi
                      while [ ! -s "$dist" ]; do sleep 0.5; done
                      node_flags=(--nnodes "$ROLLOUT_NODES_PER_SERVER" --node-rank "$node_rank" --dist-init-addr "$(cat "$dist")")
                  fi
                  echo "rollout-task node=$SLURMD_NODENAME localid=$SLURM_LOCALID node_rank=$node_rank gpus=${CUDA_VISIBLE_DEVICES:-all}"
                  log="$ROLLOUT_JOB_DIR/server-${SLURM_PROCID:-0}.log"
                  stop=0; trap "stop=1; kill -TERM \$child 2>/dev/null" TERM INT
                  port=0; restarts=0
                  while :; do
                      "$@" "${node_flags[@]}" --port "$port" & child=$!
                      wait "$child"; rc=$?
                      [ "$stop" = 1 ] && wait "$child" 2>/dev/null
                      if [ "$stop" = 1 ] || { [ "$rc" = 0 ] && [ "$node_rank" = 0 ]; } || [ "$restarts" -ge "$ROLLOUT_MAX_RESTARTS" ]; then exit "$rc"; fi
                      [ "$node_rank" = 0 ] && port=$(sed -n "s/.*rollout-serve listening on http:.*:\([0-9][0-9]*\)$/\1/p" "$log" | tail -n 1)
                      restarts=$((restarts + 1))
                      echo "rollout-task: rollout-serve exited with $rc; restart $restarts on port ${port:=0}"
                      sleep 1
                  done' rollout-task "${serve_cmd[@]}" "${flags[@]}" &
    ROLLOUT_SERVER_STEP_PID=$!
    rollout_track "$ROLLOUT_SERVER_STEP_PID" srun
    ROLLOUT_EXPECTED_SERVERS=$((nnodes * ROLLOUT_SERVERS_PER_NODE / per))
}

# rollout_wait_servers: waits for every server's port line and /health, then writes
# ROLLOUT_SERVERS_FILE (one URL per line, in node order). Fails if the step dies or time runs out.
rollout_wait_servers() {
    local deadline=$((SECONDS + ROLLOUT_HEALTH_TIMEOUT)) log node port urls=() ok
    while :; do
        if ! kill -0 "$ROLLOUT_SERVER_STEP_PID" 2>/dev/null; then
            rollout_log "error: the server step exited before all servers were healthy; logs:"
            tail -n 30 "$ROLLOUT_JOB_DIR"/server-*.log 2>/dev/null
            return 1
        fi
        urls=()
        for log in "$ROLLOUT_JOB_DIR"/server-*.log; do
            [ -e "$log" ] || continue
            port=$(sed -n 's|.*rollout-serve listening on http://[^ ]*:\([0-9][0-9]*\).*|\1|p' "$log" | head -n 1)
            [ -n "$port" ] || continue
            node=$(sed -n 's/^rollout-task node=\([^ ]*\).*/\1/p' "$log" | head -n 1)
            urls+=("http://$(rollout_node_addr "$node"):$port")
        done
        if [ "${#urls[@]}" -eq "$ROLLOUT_EXPECTED_SERVERS" ]; then
            ok=1
            for u in "${urls[@]}"; do rollout_http_ok "$u/health" || { ok=0; break; }; done
            if [ "$ok" -eq 1 ]; then
                printf '%s\n' "${urls[@]}" > "$ROLLOUT_SERVERS_FILE.tmp"
                mv "$ROLLOUT_SERVERS_FILE.tmp" "$ROLLOUT_SERVERS_FILE"
                rollout_log "all ${#urls[@]} server(s) healthy; list in $ROLLOUT_SERVERS_FILE"
                return 0
            fi
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            rollout_log "error: ${#urls[@]}/$ROLLOUT_EXPECTED_SERVERS server(s) up, not all healthy after ${ROLLOUT_HEALTH_TIMEOUT}s"
            tail -n 30 "$ROLLOUT_JOB_DIR"/server-*.log 2>/dev/null
            return 1
        fi
        sleep 1
    done
}

# rollout_smoke_test: one /generate with routing per server; prints each routing shape.
rollout_smoke_test() {
    "$ROLLOUT_PYTHON" - "$ROLLOUT_SERVERS_FILE" "$ROLLOUT_API_KEY" <<'PY'
import base64, json, sys, urllib.request
servers = [s.strip() for s in open(sys.argv[1]) if s.strip()]
headers = {"content-type": "application/json"}
if sys.argv[2]:
    headers["Authorization"] = "Bearer " + sys.argv[2]
info = {}
for url in servers:
    body = {"text": "Q: 12+7= A:", "sampling_params": {"temperature": 0, "max_new_tokens": 4},
            "return_logprob": True, "return_routed_experts": True}
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), headers)
    out = json.load(urllib.request.urlopen(req, timeout=120))
    meta = out["meta_info"]
    n_bytes = len(base64.b64decode(meta["routed_experts"]))
    rows = meta["prompt_tokens"] + meta["completion_tokens"] - 1
    print(f"smoke-test {url}: {meta['completion_tokens']} tokens, routing {n_bytes} bytes = "
          f"{rows} rows x {n_bytes // 4 // rows} int32 ids, finish {meta['finish_reason']['type']}", flush=True)
PY
}
