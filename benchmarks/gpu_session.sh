#!/usr/bin/env bash
# One GPU session's measurements, each bounded in time, results under $OUT:
#   overhead.json   host cost of attnhub.attention vs direct SDPA (forced and via policy)
#   decode_host_overhead.*  host time per triton_decode call, direct launch on/off, vs SDPA
#   gpu_tests.txt   every test marked `gpu`, on the final code
#   llama8b/        `attnhub run` at Llama-8B shape, decode backends compared (run_llama8b.sh)
# Usage on the H200 (wheels carried in .whl): COMMIT=abc1234 bash benchmarks/gpu_session.sh
set -uo pipefail
out=${OUT:-out/gpu_session}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/pydantic*.whl .whl/typing*.whl .whl/annotated*.whl .whl/fa3*.whl
root=$(pwd)
export PYTHONPATH=/tmp/site:$root
mods=""
for p in triton_portable sm80_fa2 sm90_fa3 hybrid_linear ring rocm; do
  PYTHONPATH=$PYTHONPATH:$root/plugins/$p; mods=$mods${mods:+,}attnhub_$p.plugin
done
export PYTHONPATH ATTNHUB_PLUGIN_MODULES=$mods PYTHONUNBUFFERED=1
{ date -u +%FT%TZ; echo "commit ${COMMIT:-?}"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } > "$out/env.txt"
timeout 60 python3 benchmarks/overhead.py --json > "$out/overhead.json" 2> "$out/overhead.log"
timeout 90 python3 benchmarks/decode_host_overhead.py --device cuda --json "$out/decode_host_overhead.json" \
  > "$out/decode_host_overhead.txt" 2>&1; tail -25 "$out/decode_host_overhead.txt"
timeout 150 python3 -m pytest -m gpu plugins tests -q -rs > "$out/gpu_tests.txt" 2>&1
tail -3 "$out/gpu_tests.txt"
WHEELS=none ROUNDS=${ROUNDS:-2} timeout ${LLAMA_S:-300} bash benchmarks/run_llama8b.sh "$out/llama8b" > "$out/llama8b.txt" 2>&1
tail -12 "$out/llama8b.txt"
cat "$out/overhead.json"
