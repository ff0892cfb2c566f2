#!/usr/bin/env bash
# Issue 6, speed item: `attnhub run` on a Llama-8B-shaped decoder (32 layers, 32 query / 8 KV
# heads, head dim 128, hidden 4096, MLP 14336, vocab 128256, bf16) with batch 16, 4k prompts
# and 256 new tokens through the paged KV cache: decode tokens/s of the default policy's
# binding and of every available decode backend forced on all layers (same prefill). First
# `attnhub bench` times each decode kernel alone on the same shape (each checked first) and
# records it in the profile store, which the default policy's `fastest` decode rule reads.
#
# On the H200 machine, from the repository root, with the wheels the image lacks in
# $WHEELS (default .whl; see ../shared/gpu/wheels.sh: pydantic is required, fa3-fwd optional;
# flashinfer is left out on purpose: its first decode kernel JIT-compiles for ~90 s):
#   bash benchmarks/run_llama8b.sh [OUT_DIR]
# Writes run_llama8b.json, bench_decode.json, bench_decode.md and the logs into OUT_DIR.
# SMOKE=1 runs the same commands at tiny sizes (a check of the script on a CPU).
set -euo pipefail
out=${1:-${OUT:-out/llama8b}}
wheels=${WHEELS:-.whl}
mkdir -p "$out"
if compgen -G "$wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$wheels"/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
root=$(pwd)
export PYTHONPATH=${PYTHONPATH:-}
for p in triton_portable sm80_fa2 sm90_fa3; do PYTHONPATH=$root/plugins/$p:$PYTHONPATH; done
export PYTHONPATH=$root:$PYTHONPATH PYTHONUNBUFFERED=1
export ATTNHUB_PLUGIN_MODULES=attnhub_triton_portable.plugin,attnhub_sm80_fa2.plugin,attnhub_sm90_fa3.plugin
export ATTNHUB_PROFILE=$out/profile.json
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
python3 -m attnhub doctor | tee "$out/doctor.txt"

SHAPE=(--heads 32:8 --head-dim 128 --dtype bf16 --page-size 16 --batch 16)
MODEL=(--layers 32 --intermediate 14336 --vocab 128256 --prompt-len 4096 --new-tokens 256)
CTX=4352
if [[ -n ${SMOKE:-} ]]; then
  SHAPE=(--heads 4:2 --head-dim 16 --dtype fp32 --page-size 4 --batch 2)
  MODEL=(--layers 2 --vocab 64 --prompt-len 16 --new-tokens 4)
  CTX=20
fi
python3 -m attnhub bench "${SHAPE[@]}" --layers 1 --vocab 256 --phases decode --seqlens $CTX \
  --repeats 20 --warmup 5 --no-progress --md "$out/bench_decode.md" --json \
  > "$out/bench_decode.json" 2> "$out/bench_decode.log" || echo "bench exit $?"
cat "$out/bench_decode.md"
python3 -m attnhub run "${SHAPE[@]}" "${MODEL[@]}" --warmup 2 --compare-decode --compare-rounds ${ROUNDS:-1} --no-progress --json \
  > "$out/run_llama8b.json" 2> "$out/run_llama8b.log" || echo "run exit $?" | tee -a "$out/run_llama8b.log"
python3 - "$out/run_llama8b.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print({k: round(v["tokens_per_s"], 1) for k, v in r["phases"].items()}, r.get("check"))
for row in r.get("decode_backends", []):
    print(row)
PY
