#!/usr/bin/env bash
# agentd against llama.cpp's llama-server on one GGUF file (its own weights in both), side by side
# in one run, `agentd bench` measuring both the same way: start to ready, peak RSS (VmHWM of the
# server process), cold TTFT, warm TTFT p50, output tokens/s at c=1 and at c=8 (8 agents sharing
# one ~2,000-token coding-agent prefix, 32 greedy tokens each, EOS ignored). Each server runs
# alone, one after the other; a table of both ends the run (OUT_DIR/summary.md).
#
#   benchmarks/peers_gguf.sh MODEL.gguf OUT_DIR [native|avx2] [agentd start options...]
#
# Random-weight files of real shapes come from `python -m agentd.model.synth` (values are noise,
# speed and memory are real). avx2 caps torch, oneDNN and agentd's own kernels at AVX2
# (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 AGENTD_CPU_ISA=avx2); llama-server runs the
# build it is given (for an AVX2 column on an AVX-512 host, one built with GGML_NATIVE=OFF
# GGML_AVX2=ON). Both get the tools as system text (--tools-in-system), so the prompts are equal.
#
# What each server is given (state it with the figures):
# - llama-server: -fa on -t THREADS -np 8 -c 8*LLAMA_CTX_PER_SLOT (default 2,560 tokens a slot:
#   one agent's prompt and answer; f16 KV, allocated at start), its defaults otherwise: weight
#   repacking on, prompt cache (--cache-ram 8192 MiB) on, so a slot may load a prefix another slot
#   computed instead of prefilling it.
# - agentd: `agentd start --model MODEL.gguf --num-threads THREADS` (plus --kv-cache-memory
#   AGENTD_KV_MEMORY when set; unset: agentd sizes its pool itself) and the options given here
#   (later ones win), with whatever that start does with a .gguf today.
# Env: LLAMA_SERVER (a llama-server binary; unset: skipped), SERVERS (default "agentd llama"),
# THREADS (nproc), REQUESTS (8 per phase; 2 with QUICK), CONCURRENCY (1,8), PROMPT_TOKENS (2000), MAX_TOKENS
# (32), COLD_REQUESTS (3), NO_EMPTY=1 (skip the last phase, 8 cold prefills at once: ~15 min
# of an 8B model's prefill on 2 cores), QUICK=1 (bench --quick), TOKENIZER (sizes the prompts;
# default agentd's default model's, which is the synth files' own), PYTHON. A server that does
# not come up is reported and skipped.
# Long on a small CPU: every cold request prefills the whole prompt. Not run in CI.
set -euo pipefail
gguf=$(realpath "$1"); out=$2; isa=${3:-native}; shift $(( $# >= 3 ? 3 : $# ))
mkdir -p "$out"
if [ "$isa" = avx2 ]; then export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 AGENTD_CPU_ISA=avx2; fi
py=${PYTHON:-python}
threads=${THREADS:-$(nproc)}
np=8; llama_ctx=$(( np * ${LLAMA_CTX_PER_SLOT:-2560} ))
agentd=("$py" -m agentd.cli)
bench=("${agentd[@]}" bench --no-pin --no-pressure --conversations 0 --tools-in-system
       --concurrency "${CONCURRENCY:-1,8}" --prompt-tokens "${PROMPT_TOKENS:-2000}" --max-tokens "${MAX_TOKENS:-32}"
       --cold-requests "${COLD_REQUESTS:-3}")
if [ -n "${NO_EMPTY:-}" ]; then bench+=(--no-empty-cache); fi
if [ -n "${QUICK:-}" ]; then bench+=(--quick); else bench+=(--requests "${REQUESTS:-8}"); fi
if [ -n "${TOKENIZER:-}" ]; then bench+=(--tokenizer "$TOKENIZER"); fi
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$tmp"' EXIT
header=$out/$isa-header.txt

{
  echo "# $(date -u +%FT%TZ) · $(basename "$gguf") ($(stat -c %s "$gguf") bytes) · ISA column: $isa"
  lscpu | grep -E '^(Model name|Flags):'
  "$py" -c "import torch; print('torch', torch.__version__, 'capability',
    torch.backends.cpu.get_cpu_capability())"
  "$py" -c "from agentd.kernels import cpu; print('agentd kernels:', cpu.active_isa(),
    cpu.native_unavailable_reason() or '')" 2>/dev/null || echo "agentd kernels: not importable"
  echo "env: ATEN_CPU_CAPABILITY=${ATEN_CPU_CAPABILITY:-} ONEDNN_MAX_CPU_ISA=${ONEDNN_MAX_CPU_ISA:-}" \
       "AGENTD_CPU_ISA=${AGENTD_CPU_ISA:-}; threads $threads"
  echo "load average: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) CPUs (shared machine)"
} | tee "$header"

servers=${SERVERS:-agentd llama}
wants() { [[ " $servers " == *" $1 "* ]]; }

run_server() {  # name port log cmd...: start, time to ready, bench, peak RSS, stop
  local name=$1 port=$2 log=$3; shift 3
  local start_s; start_s=$(date +%s.%N)
  "$@" >"$log" 2>&1 &
  local pid=$! ready=""
  for _ in $(seq 12000); do
    if curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1; then ready=1; break; fi
    kill -0 $pid 2>/dev/null || break
    sleep 0.1
  done
  if [ -z "$ready" ]; then
    echo "!! $name did not come up; the end of $log:" | tee -a "$header"
    tail -5 "$log" | tee -a "$header"
  else
    echo "$(date +%s.%N) - $start_s" | bc >"$out/$isa-$name.ready_s"
    [ "$name" = agentd ] && "${agentd[@]}" status --url "http://127.0.0.1:$port" | tee -a "$header"
    local extra=(); [ "$name" = agentd ] || extra=(--openai-compatible --daemon-pid $pid)
    "${bench[@]}" --url "http://127.0.0.1:$port" "${extra[@]}" --json "$out/$isa-$name.json" \
      | tee "$out/$isa-$name.txt" || echo "!! $name: bench failed" | tee -a "$header"
    grep VmHWM /proc/$pid/status | awk '{printf "%.0f\n", $2 * 1024}' >"$out/$isa-$name.hwm_bytes"
  fi
  kill -INT $pid 2>/dev/null || true; wait $pid || true
}

if wants agentd; then
  echo "== agentd start --model $gguf $*" | tee -a "$header"
  run_server agentd 8311 "$out/$isa-agentd.log" "${agentd[@]}" start --model "$gguf" \
    --port 8311 --state-dir "$tmp/agentd" --num-threads "$threads" \
    ${AGENTD_KV_MEMORY:+--kv-cache-memory "$AGENTD_KV_MEMORY"} "$@"
fi

if wants llama && [ -n "${LLAMA_SERVER:-}" ]; then
  echo "== llama-server -fa on -t $threads -np $np -c $llama_ctx" | tee -a "$header"
  run_server llama 8312 "$out/$isa-llama.log" "$LLAMA_SERVER" -m "$gguf" --host 127.0.0.1 \
    --port 8312 -fa on -t "$threads" -np $np -c $llama_ctx
fi

"$py" - "$out" "$isa" <<'EOF' | tee "$out/$isa-summary.md"
import json, sys
from pathlib import Path

out, isa = Path(sys.argv[1]), sys.argv[2]
def read(name: str, suffix: str) -> str | None:
    path = out / f"{isa}-{name}.{suffix}"
    return path.read_text().strip() if path.is_file() else None

def tok_s(phases: dict, name: str) -> str:
    phase = phases.get(name)
    if not phase or not phase["wall_s"]:
        return "-"
    return f"{sum(r['output_tokens'] for r in phase['requests']) / phase['wall_s']:.1f}"

print("| server | ready s | peak RSS MiB | cold TTFT s | warm TTFT p50 ms | tok/s c=1 | tok/s c=8 |")
print("|---|---|---|---|---|---|---|")
for name in ("agentd", "llama"):
    if read(name, "json") is None:
        continue
    run = json.loads(read(name, "json"))["workloads"][0]
    fig, phases = run["figures"], run["phases"]
    hwm, cold, warm = read(name, "hwm_bytes"), fig["cold_ttft_s"], fig["warm_unpinned_ttft_p50_s"]
    print(f"| {name} | {float(read(name, 'ready_s')):.1f} | "
          f"{int(hwm) / 2**20:,.0f} | {'-' if cold is None else f'{cold:.2f}'} | "
          f"{'-' if warm is None else f'{warm * 1000:.0f}'} | {tok_s(phases, 'c1')} | "
          f"{tok_s(phases, 'c8')} |")
EOF
