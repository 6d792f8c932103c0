#!/usr/bin/env bash
# Run a chat instance and an embedding instance side by side, with the machine's memory split between them; and,
# when RERANK_MODEL (--rerank-model) names one, a third instance serving a reranker (/v1/rerank, /score, /classify).
#
#   scripts/serve_pair.sh start    start both, wait until both /health answer 200, print curl commands to try
#   scripts/serve_pair.sh stop     SIGTERM both, wait until every process of theirs is gone (SIGKILL after a timeout)
#   scripts/serve_pair.sh status   running or stopped, with /health; exit 0 only when both are running
#
# Logs go to $DIR/logs/{chat,embed}.log, pids and ports to $DIR/run/{chat,embed}.{pid,port}. Each instance runs in a
# session of its own (setsid), so stop can check that none of its processes is left, and Ctrl-C in this shell or
# closing it does not reach the servers.
#
# Memory split: on GPU each instance gets a share of the device (--gpu-memory-utilization: chat 0.6, embeddings
# 0.25; the embedding instance is held to its share). On CPU the chat instance gets a KV-cache budget
# (--kv-cache-memory-bytes); the embedding instance keeps no KV cache at all, so it needs none.
#
# Settings (environment variable, or the flag after the command):
#   TOKENMILL_PAIR_DIR  --dir DIR           where logs/ and run/ go (default: the repository root)
#   CHAT_PORT           --chat-port N       8000
#   EMBED_PORT          --embed-port N      8001
#   CHAT_MODEL          --chat-model M      the shipped SmolLM2-135M-Instruct
#   EMBED_MODEL         --embed-model M     the shipped all-MiniLM-L6-v2 (always served with --task embed)
#   CHAT_GPU_UTIL       --chat-gpu-util F   0.6
#   EMBED_GPU_UTIL      --embed-gpu-util F  0.25
#   CHAT_KV_CACHE       --chat-kv-cache B   2GiB (CPU KV budget of the chat instance)
#   RERANK_MODEL        --rerank-model M    none: no third instance (a cross-encoder, e.g. a
#                                           ...ForSequenceClassification directory, always served with --task score)
#   RERANK_PORT         --rerank-port N     8002
#   RERANK_GPU_UTIL     --rerank-gpu-util F 0.1
#   CHAT_ARGS / EMBED_ARGS / RERANK_ARGS    more `tokenmill serve` flags for one instance (word-split); a decoder
#                                           reranker passes its --hf-overrides here
#   PAIR_HOST           --host H            0.0.0.0 (the health checks and curl examples use 127.0.0.1)
#   PYTHON                                  python3
#   START_TIMEOUT / STOP_TIMEOUT            300 / 30 seconds
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${TOKENMILL_PAIR_DIR:-$ROOT}"
CHAT_PORT="${CHAT_PORT:-8000}"
EMBED_PORT="${EMBED_PORT:-8001}"
CHAT_MODEL="${CHAT_MODEL:-}"
EMBED_MODEL="${EMBED_MODEL:-}"
CHAT_GPU_UTIL="${CHAT_GPU_UTIL:-0.6}"
EMBED_GPU_UTIL="${EMBED_GPU_UTIL:-0.25}"
CHAT_KV_CACHE="${CHAT_KV_CACHE:-2GiB}"
PAIR_HOST="${PAIR_HOST:-0.0.0.0}"
PYTHON="${PYTHON:-python3}"
START_TIMEOUT="${START_TIMEOUT:-300}"
STOP_TIMEOUT="${STOP_TIMEOUT:-30}"
RERANK_MODEL="${RERANK_MODEL:-}"
RERANK_PORT="${RERANK_PORT:-8002}"
RERANK_GPU_UTIL="${RERANK_GPU_UTIL:-0.1}"
INSTANCES=(chat embed)

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
    exit 2
}

[[ $# -ge 1 ]] || usage
COMMAND="$1"
shift
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dir) DIR="${2:?--dir needs a value}" ;;
        --chat-port) CHAT_PORT="${2:?--chat-port needs a value}" ;;
        --embed-port) EMBED_PORT="${2:?--embed-port needs a value}" ;;
        --chat-model) CHAT_MODEL="${2:?--chat-model needs a value}" ;;
        --embed-model) EMBED_MODEL="${2:?--embed-model needs a value}" ;;
        --chat-gpu-util) CHAT_GPU_UTIL="${2:?--chat-gpu-util needs a value}" ;;
        --embed-gpu-util) EMBED_GPU_UTIL="${2:?--embed-gpu-util needs a value}" ;;
        --chat-kv-cache) CHAT_KV_CACHE="${2:?--chat-kv-cache needs a value}" ;;
        --rerank-model) RERANK_MODEL="${2:?--rerank-model needs a value}" ;;
        --rerank-port) RERANK_PORT="${2:?--rerank-port needs a value}" ;;
        --rerank-gpu-util) RERANK_GPU_UTIL="${2:?--rerank-gpu-util needs a value}" ;;
        --host) PAIR_HOST="${2:?--host needs a value}" ;;
        *) echo "unknown option: $1" >&2; usage ;;
    esac
    shift 2
done
LOG_DIR="$DIR/logs"
RUN_DIR="$DIR/run"
# the reranker: started when named; stopped and reported whenever it was started (its pid file is there)
if [[ -n "$RERANK_MODEL" || ( "$COMMAND" != start && -f "$RUN_DIR/rerank.pid" ) ]]; then
    INSTANCES+=(rerank)
fi

# ------------------------------------------------------------------ one instance

pid_of() {  # the instance's pid, if its pid file names a live tokenmill process
    local file="$RUN_DIR/$1.pid" pid
    [[ -f "$file" ]] || return 1
    pid="$(cat "$file")"
    [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null || return 1
    # a stale pid file may name a pid the system has reused for something else: never signal that
    tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -q "tokenmill" || return 1
    echo "$pid"
}

group_alive() {  # any process left in the instance's session / process group (its pgid is the server's pid)
    kill -0 -- "-$1" 2>/dev/null
}

port_of() {
    case "$1" in chat) echo "$CHAT_PORT" ;; embed) echo "$EMBED_PORT" ;; rerank) echo "$RERANK_PORT" ;; esac
}

health_code() {  # HTTP status of /health, 000 when nothing answers
    curl -s -o /dev/null -m 3 -w '%{http_code}' "http://127.0.0.1:$1/health" || true
}

launch() {
    local name="$1" port
    port="$(port_of "$name")"
    local args=(-m tokenmill.cli serve)
    if [[ "$name" == chat ]]; then
        [[ -n "$CHAT_MODEL" ]] && args+=("$CHAT_MODEL")
        args+=(--gpu-memory-utilization "$CHAT_GPU_UTIL" --kv-cache-memory-bytes "$CHAT_KV_CACHE")
        # shellcheck disable=SC2206  # word-splitting the extra flags is the point
        args+=(${CHAT_ARGS:-})
    elif [[ "$name" == rerank ]]; then
        args+=("$RERANK_MODEL" --task score --gpu-memory-utilization "$RERANK_GPU_UTIL")
        # shellcheck disable=SC2206
        args+=(${RERANK_ARGS:-})
    else
        [[ -n "$EMBED_MODEL" ]] && args+=("$EMBED_MODEL")
        args+=(--task embed --gpu-memory-utilization "$EMBED_GPU_UTIL")
        # shellcheck disable=SC2206
        args+=(${EMBED_ARGS:-})
    fi
    args+=(--host "$PAIR_HOST" --port "$port")
    (cd "$ROOT" && PYTHONUNBUFFERED=1 exec setsid "$PYTHON" "${args[@]}" > "$LOG_DIR/$name.log" 2>&1 < /dev/null) &
    echo $! > "$RUN_DIR/$name.pid"
    echo "$port" > "$RUN_DIR/$name.port"
    echo "started $name (pid $!, port $port): $PYTHON ${args[*]}"
}

stop_all() {  # SIGTERM every instance at once, then wait for each one's processes to be gone
    local name pid waited
    local -A pids=()
    for name in "${INSTANCES[@]}"; do
        if pid="$(pid_of "$name")"; then
            pids[$name]="$pid"
            kill -TERM "$pid" 2>/dev/null || true
        else
            echo "$name: not running"
        fi
    done
    for name in "${!pids[@]}"; do
        pid="${pids[$name]}"
        waited=0
        while group_alive "$pid" && (( waited < STOP_TIMEOUT * 10 )); do
            sleep 0.1
            waited=$((waited + 1))
        done
        if group_alive "$pid"; then
            echo "$name: still running ${STOP_TIMEOUT}s after SIGTERM; sending SIGKILL" >&2
            kill -KILL -- "-$pid" 2>/dev/null || true
            sleep 0.5
        fi
        echo "$name: stopped (pid $pid)"
    done
    for name in "${INSTANCES[@]}"; do
        rm -f "$RUN_DIR/$name.pid" "$RUN_DIR/$name.port"
    done
}

log_tail() {
    echo "---- last lines of $LOG_DIR/$1.log ----" >&2
    tail -n 30 "$LOG_DIR/$1.log" >&2 || true
    echo "----" >&2
}

# ------------------------------------------------------------------ commands

start() {
    local name
    for name in "${INSTANCES[@]}"; do
        if pid_of "$name" > /dev/null; then
            echo "$name is already running (pid $(pid_of "$name")); run '$0 stop' first" >&2
            exit 1
        fi
    done
    command -v curl > /dev/null || { echo "serve_pair.sh needs curl for the health checks" >&2; exit 1; }
    mkdir -p "$LOG_DIR" "$RUN_DIR"
    for name in "${INSTANCES[@]}"; do
        launch "$name"
    done

    local deadline=$((SECONDS + START_TIMEOUT)) healthy=() pending
    while :; do
        pending=0
        for name in "${INSTANCES[@]}"; do
            [[ " ${healthy[*]-} " == *" $name "* ]] && continue
            if ! pid_of "$name" > /dev/null; then
                echo "$name exited while starting" >&2
                log_tail "$name"
                stop_all > /dev/null
                exit 1
            fi
            if [[ "$(health_code "$(port_of "$name")")" == 200 ]]; then
                healthy+=("$name")
                echo "$name is ready on port $(port_of "$name")"
            else
                pending=$((pending + 1))
            fi
        done
        (( pending == 0 )) && break
        if (( SECONDS >= deadline )); then
            echo "not ready after ${START_TIMEOUT}s" >&2
            for name in "${INSTANCES[@]}"; do log_tail "$name"; done
            stop_all > /dev/null
            exit 1
        fi
        sleep 1
    done

    cat <<EOF

The instances are up (${INSTANCES[*]}). Logs: $LOG_DIR/<name>.log; stop them with: $0 stop

  curl http://127.0.0.1:$CHAT_PORT/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32}'

  curl http://127.0.0.1:$EMBED_PORT/v1/embeddings -H 'Content-Type: application/json' \\
    -d '{"input": ["The cat sat on the mat.", "A feline rested on the rug."]}'
EOF
    if [[ " ${INSTANCES[*]} " == *" rerank "* ]]; then
        cat <<EOF

  curl http://127.0.0.1:$RERANK_PORT/v1/rerank -H 'Content-Type: application/json' \\
    -d '{"query": "Where do cats sleep?", "documents": ["On the mat.", "Paris is in France."], "top_n": 1}'
EOF
    fi
}

status() {
    local name pid port all_running=0
    for name in "${INSTANCES[@]}"; do
        if pid="$(pid_of "$name")"; then
            port="$(cat "$RUN_DIR/$name.port" 2>/dev/null || port_of "$name")"
            echo "$name: running (pid $pid, port $port, /health $(health_code "$port"))"
        else
            echo "$name: stopped"
            all_running=3
        fi
    done
    return "$all_running"
}

case "$COMMAND" in
    start) start ;;
    stop) stop_all ;;
    status) status ;;
    *) usage ;;
esac
