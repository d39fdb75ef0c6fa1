#!/usr/bin/env bash
# The model server's entry command (the image of deploy/Containerfile runs it as
# `spyre-serve`): `vllm serve` on the spyre card, with the settings llm-d's
# inference scheduler relies on.  docs/llm-d.md describes it.
#
#   spyre-serve MODEL [vllm serve arguments...]
#   spyre-serve --model MODEL [vllm serve arguments...]   (llm-d's modelservice chart)
#
# MODEL is a checkpoint folder, a Hugging Face name (with HF_HUB_OFFLINE=0), or
# offline:NAME for a model that ships with the image (offline:smollm2); without
# one, SPYRE_MODEL.  Every other argument goes to `vllm serve` unchanged and wins
# over the defaults below (argparse keeps the last value of a repeated flag).
# --tensor-parallel-size N (or SPYRE_TENSOR_PARALLEL=N) also gives the process N
# cards (TORCH_SPYRE_NUM_CARDS), one per vLLM worker.
#
# Readiness: vLLM answers /health with 200 only once the engine is up, and the
# spyre plugin compiles every token bucket before that (TORCH_SPYRE_VLLM_WARMUP,
# docs/serving.md), so a pod is ready exactly when requests no longer pay a
# compile.  Metrics: the API server's /metrics (the serving port) carries vLLM's
# series and the worker's spyre:* series, so the endpoint picker scrapes one port.
set -euo pipefail

python="${SPYRE_PYTHON:-python3}"
model=""
tp="${SPYRE_TENSOR_PARALLEL:-}"
args=("$@")
rest=()
if [ "${#args[@]}" -gt 0 ] && [[ "${args[0]}" != -* ]]; then
  model="${args[0]}"
  args=("${args[@]:1}")
fi
i=0
while [ "$i" -lt "${#args[@]}" ]; do
  a="${args[$i]}"
  case "$a" in
    --model)
      model="${args[$((i + 1))]:-}"
      i=$((i + 2))
      continue
      ;;
    --model=*) model="${a#--model=}" ;;
    --tensor-parallel-size | -tp) tp="${args[$((i + 1))]:-}" ;;
    --tensor-parallel-size=*) tp="${a#*=}" ;;
  esac
  case "$a" in
    --model=*) ;;
    *) rest+=("$a") ;;
  esac
  i=$((i + 1))
done
model="${model:-${SPYRE_MODEL:-}}"
if [ -z "$model" ]; then
  echo "spyre-serve: name the model: spyre-serve MODEL [vllm serve args] (or --model, or SPYRE_MODEL)" >&2
  exit 2
fi
served_name="${SPYRE_SERVED_MODEL_NAME:-}"
case "$model" in
  offline:*)
    name="${model#offline:}"
    served_name="${served_name:-$name}"
    model=$("$python" -c "import sys; from torch_spyre.models.offline import folder; print(folder(sys.argv[1]))" "$name")
    ;;
esac
served_name="${served_name:-$model}"

# no downloads at start unless asked: the model is in the image or a volume
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
# every bucket compiled before /health is 200 (the startup probe waits for it)
export TORCH_SPYRE_VLLM_WARMUP="${TORCH_SPYRE_VLLM_WARMUP:-all}"
# the worker's spyre:* series; the API server's /metrics includes them
export TORCH_SPYRE_VLLM_METRICS_PORT="${TORCH_SPYRE_VLLM_METRICS_PORT:-9100}"
extra=()
if [ -n "$tp" ]; then
  # one card per worker: the process needs as many cards as the TP size
  export TORCH_SPYRE_NUM_CARDS="${TORCH_SPYRE_NUM_CARDS:-$tp}"
  extra=(--tensor-parallel-size "$tp")
fi

echo "spyre-serve: $model as '$served_name' on port ${SPYRE_PORT:-8000}" \
  "(cards ${TORCH_SPYRE_NUM_CARDS:-1}, warm-up ${TORCH_SPYRE_VLLM_WARMUP}," \
  "worker metrics port ${TORCH_SPYRE_VLLM_METRICS_PORT})" >&2
# exec: SIGTERM from the kubelet reaches vLLM, which drains for --shutdown-timeout
exec "$python" -m vllm.entrypoints.cli.main serve "$model" \
  --host "${SPYRE_HOST:-0.0.0.0}" --port "${SPYRE_PORT:-8000}" \
  --served-model-name "$served_name" \
  --shutdown-timeout "${SPYRE_SHUTDOWN_TIMEOUT_S:-30}" \
  "${extra[@]}" "${rest[@]}"
