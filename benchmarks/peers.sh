#!/usr/bin/env bash
# agentd against llama.cpp's llama-server and vLLM's CPU build, side by side in one run, on the
# default model (the same Q4_1 GGUF for llama-server; its fp32 conversion for vLLM), with
# `agentd bench` measuring all three the same way. Each server runs alone, one after the other.
#
#   benchmarks/peers.sh OUT_DIR [native|avx2] [agentd start options...]
#
# avx2 caps torch and oneDNN at AVX2 (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2) for
# agentd and vLLM (vLLM's own compiled kernels are not capped); llama-server runs the build it
# is given (for avx2, one whose ggml-cpu was built with GGML_NATIVE=OFF GGML_AVX2=ON). vLLM runs
# fp32 (its bf16 default wants bf16 GEMMs). Every server gets the tools as system text
# (--tools-in-system): SmolLM2's template drops a tools field, so the prompts are the same.
# Set LLAMA_SERVER to a llama-server binary and VLLM to a `vllm` executable (each built or
# installed outside this repo); a server whose variable is unset is skipped, and SERVERS
# (default "agentd llama vllm") picks which run.
# A server that does not come up is reported and skipped. Not run in CI.
set -euo pipefail
out=$1; isa=${2:-native}; shift $(( $# >= 2 ? 2 : $# ))
mkdir -p "$out"
if [ "$isa" = avx2 ]; then export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2; fi
py=${PYTHON:-python}
agentd=("$py" -m agentd.cli)
bench=("${agentd[@]}" bench --no-pin --no-pressure --conversations 0 --concurrency 1,8
       --tools-in-system --requests "${REQUESTS:-8}")
gguf=$("$py" -c "from agentd.model.default_model import default_gguf_path as p; print(p())")
hf_dir=$("$py" -c "from agentd.model.loader import resolve_model as r; print(r(None).path)")
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$tmp"' EXIT

{
  echo "# $(date -u +%FT%TZ) · ISA column: $isa"
  grep -m1 -o 'avx2\|avx512f\|avx512_bf16\|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' '
  echo
  "$py" -c "import torch; print('torch', torch.__version__, 'capability',
    torch.backends.cpu.get_cpu_capability())"
  echo "load average: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) CPUs (shared machine)"
} | tee "$out/$isa-header.txt"

servers=${SERVERS:-agentd llama vllm}
wants() { [[ " $servers " == *" $1 "* ]]; }

wait_ready() {  # url pid log
  for _ in $(seq 1200); do
    curl -sf "$1" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || break
    sleep 1
  done
  echo "!! did not come up; the end of $3:" | tee -a "$out/$isa-header.txt"
  tail -5 "$3" | tee -a "$out/$isa-header.txt"
  return 1
}

if wants agentd; then
  echo "== agentd $*" | tee -a "$out/$isa-header.txt"
  port=8311
  "${agentd[@]}" start --port $port --state-dir "$tmp/agentd" "$@" >"$out/$isa-agentd.log" 2>&1 &
  pid=$!
  if wait_ready "http://127.0.0.1:$port/health" $pid "$out/$isa-agentd.log"; then
    "${agentd[@]}" status --url "http://127.0.0.1:$port" | tee -a "$out/$isa-header.txt"
    "${bench[@]}" --url "http://127.0.0.1:$port" --json "$out/$isa-agentd.json" \
      | tee "$out/$isa-agentd.txt"
  fi
  kill -INT $pid 2>/dev/null || true; wait $pid || true
fi

if wants llama && [ -n "${LLAMA_SERVER:-}" ]; then
  echo "== llama-server" | tee -a "$out/$isa-header.txt"
  port=8312
  "$LLAMA_SERVER" -m "$gguf" --host 127.0.0.1 --port $port -fa on -np 8 -c 24576 \
    -t "$(nproc)" >"$out/$isa-llama.log" 2>&1 &
  pid=$!
  if wait_ready "http://127.0.0.1:$port/health" $pid "$out/$isa-llama.log"; then
    "${bench[@]}" --url "http://127.0.0.1:$port" --openai-compatible --daemon-pid $pid \
      --json "$out/$isa-llama.json" | tee "$out/$isa-llama.txt"
  fi
  kill $pid 2>/dev/null || true; wait $pid || true
fi

if wants vllm && [ -n "${VLLM:-}" ]; then
  echo "== vLLM CPU" | tee -a "$out/$isa-header.txt"
  port=8313
  # Started outside the repo: its subprocesses would import our kernels/ as a package.
  (cd "$tmp" && VLLM_TARGET_DEVICE=cpu VLLM_HOST_IP=127.0.0.1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
    exec "$VLLM" serve "$hf_dir" --host 127.0.0.1 --port $port \
    --served-model-name SmolLM2-135M-Instruct --max-model-len 4096 --dtype float32 \
    --enable-auto-tool-choice --tool-call-parser hermes) \
    >"$out/$isa-vllm.log" 2>&1 &
  pid=$!
  if wait_ready "http://127.0.0.1:$port/health" $pid "$out/$isa-vllm.log"; then
    "${bench[@]}" --url "http://127.0.0.1:$port" --openai-compatible --daemon-pid $pid \
      --json "$out/$isa-vllm.json" | tee "$out/$isa-vllm.txt"
  fi
  kill $pid 2>/dev/null || true; wait $pid || true
fi
