#!/usr/bin/env bash
# One GPU session on the H200, one command, every step bounded in time. Timing steps run
# alone on the card first; the correctness steps (GPU tests, conformance kit) then run side
# by side. Results under $OUT (at most 8 files come back: the work happens in $work; after
# each step everything is packed into $OUT/results.tar.gz, so a run cut short still returns
# its finished steps; at the end up to 6 files worth reading are copied beside it):
#   session.log        what ran, when, with exit codes; env (date, commit, GPU, versions)
#   overhead.json      host cost of attnhub over the bound backend called directly
#   regret/            `attnhub bench --regret` over the standard grid (benchmarks/regret_session.sh:
#                      regret.{md,json,png} and the re-measured profile pack), with step `regret`
#   hf_generate.{json,md}  generate() with attn_implementation="attnhub" vs "sdpa"
#   ring_sim2.{json,md}    ring attention, 2 virtual ranks on one GPU (issue 17)
#   gpu_tests.txt      every test marked `gpu` (FlashInfer's included: it JIT-compiles)
#   kit.txt            `attnhub check-plugin --all-available --quick` on the GPU
# Usage (carry .whl, made by ../shared/gpu/wheels.sh all): COMMIT=abc1234 bash benchmarks/gpu_session.sh
# (name COMMIT here: the device's copy of .git can be older than the working tree it runs)
# STEPS picks steps (default: overhead hf ring tests kit; also: profile, a cProfile of
# overhead.py's calls; null, benchmarks/hub_null_overhead.py on GPU tensors; dho, benchmarks/decode_host_overhead.py on the GPU; grow, benchmarks/decode_growing_gpu.py; pvf, benchmarks/policy_vs_forced.py on PVF_CELLS; regret, REGRET_S seconds; probe, benchmarks/triton_autotune_probe.py (which dense forward config the autotuner takes, beside the API time); gluon_ws, benchmarks/gluon_ws.py; fp8g, benchmarks/decode_fp8_gluon.py, the Gluon FP8 decode variants beside the bf16 and FP8 rows; fp8api, benchmarks/decode_fp8_api.py, e4m3 vs bf16 paged decode through attnhub.attention; gap, benchmarks/decode_api_gap.py, the same call as kernel, backend, API and CUDA graph, with the idle gaps between calls; bwd, benchmarks/bwd_probe.py, each backward kernel timed on its own; fagrid, tests/test_fa_grid_gpu.py, FlashAttention's test grid through the API, FAGRID_S seconds, default 480; dsweep, benchmarks/decode_sweep.py (DSWEEP_ARGS, e.g. --cells 1x131072); dprobe, benchmarks/decode_layout_probe.py, where paged decode's last percent goes (layout, paging, splits, the profiler's kernels); peaked, benchmarks/peaked_grad_grid.py, half-precision gradients on nearly one-hot softmaxes for every GPU backend beside torch's raw SDPA kernels); KIT_BACKENDS names the kit's backends (default: --all-available).
set -uo pipefail
final=${OUT:-out/gpu_session}
out=${WORK:-/tmp/gpu_session}
mkdir -p "$out" "$final"
log="$out/session.log"
start=$(date +%s)
say() { echo "[$(( $(date +%s) - start ))s] $*" | tee -a "$log"; }
collect() {  # everything so far into $final/results.tar.gz, so a run cut by the device's
  # time limit still brings back what its finished steps measured
  (cd "$out" && tar czf "$final/results.tar.gz.tmp" ./* 2>/dev/null \
    && mv "$final/results.tar.gz.tmp" "$final/results.tar.gz"); cp "$log" "$final/" 2>/dev/null
}
step() {  # step NAME SECONDS CMD...: run bounded, log its exit code
  local name=$1 secs=$2; shift 2
  say "start $name (<= ${secs}s)"
  timeout "$secs" "$@" >> "$out/$name.out" 2>&1
  say "end $name rc=$?"
  collect
}

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >> "$log" 2>&1
root=$(pwd)
PYTHONPATH=/tmp/site:$root
mods=""
for p in triton_portable sm80_fa2 sm90_fa3 hybrid_linear ring rocm; do
  PYTHONPATH=$PYTHONPATH:$root/plugins/$p; mods=$mods${mods:+,}attnhub_$p.plugin
done
export PYTHONPATH ATTNHUB_PLUGIN_MODULES=$mods PYTHONUNBUFFERED=1 COMMIT=${COMMIT:-?}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{ date -u +%FT%TZ; echo "commit ${COMMIT:-?}"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} >> "$log" 2>&1
say "setup done"

steps=" ${STEPS:-overhead hf ring tests kit} "
want() { [[ $steps == *" $1 "* ]]; }

# -- timing, one at a time --------------------------------------------------------------
want overhead && step overhead 60 python3 benchmarks/overhead.py --json
cp "$out/overhead.out" "$out/overhead.json" 2>/dev/null
want profile && step profile 90 python3 benchmarks/overhead.py --profile
# the hub's own work on GPU tensors (null backend: nothing launched, stamps prove the tables)
want null && step null 60 python3 benchmarks/hub_null_overhead.py --device cuda
if want pvf; then  # policy call vs the same backend forced, per cell (PVF_CELLS: "cell=backend;...")
  IFS=';' read -ra pvf_cells <<< "${PVF_CELLS:-decode paged/16 1 x 32k=triton_decode;decode paged/16 1 x 128k=triton_decode;decode tiny 1 query, 1k keys=torch_sdpa}"
  for c in "${pvf_cells[@]}"; do
    step pvf 60 python3 benchmarks/policy_vs_forced.py --cell "${c%=*}" --backend "${c##*=}" --profile 20
  done
fi
want dho && step dho 120 python3 benchmarks/decode_host_overhead.py --device cuda \
  --json "$out/decode_host_overhead.json"
want probe && step probe "${PROBE_S:-150}" python3 benchmarks/triton_autotune_probe.py ${PROBE_ARGS:-}
want gluon_ws && step gluon_ws "${GLUON_WS_S:-190}" python3 benchmarks/gluon_ws.py \
  --json "$out/gluon_ws.json" --deadline "$(( ${GLUON_WS_S:-190} - 15 ))"
want fp8api && step fp8api "${FP8API_S:-120}" python3 benchmarks/decode_fp8_api.py --json "$out/fp8api.json"
want gap && step gap "${GAP_S:-120}" python3 benchmarks/decode_api_gap.py --json "$out/gap.json"
want bwd && step bwd "${BWD_S:-200}" python3 benchmarks/bwd_probe.py ${BWD_ARGS:-} --json "$out/bwd.json" \
  --png "$out/bwd.png"
want dprobe && step dprobe "${DPROBE_S:-150}" python3 benchmarks/decode_layout_probe.py \
  --json "$out/dprobe.json"
want dsweep && step dsweep "${DSWEEP_S:-150}" python3 benchmarks/decode_sweep.py --out "$out/dsweep" \
  --budget "$(( ${DSWEEP_S:-150} - 25 ))" --commit "${COMMIT:-?}" ${DSWEEP_ARGS:-}
want peaked && step peaked "${PEAKED_S:-150}" python3 benchmarks/peaked_grad_grid.py --json "$out/peaked.json"
want fp8g && step fp8g "${FP8G_S:-200}" python3 benchmarks/decode_fp8_gluon.py --out "$out/fp8g"
want grow && step grow "${GROW_S:-150}" python3 benchmarks/decode_growing_gpu.py ${GROW_ARGS:-} --json "$out/grow.json"
# torch's opt-in ragged cuDNN path (read once per process): does it remove the per-shape build?
want grow && step grow_ragged 90 env TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 \
  python3 benchmarks/decode_growing_gpu.py --new-lengths-only --json "$out/grow_ragged.json"
want regret && step regret "${REGRET_S:-300}" env OUT="$out/regret" BUDGET_S="$(( ${REGRET_S:-300} - 10 ))" \
  bash benchmarks/regret_session.sh
want hf && step hf_generate "${HF_S:-170}" python3 benchmarks/hf_generate.py --budget-s "$(( ${HF_S:-170} - 25 ))" \
  --hard-timeout-s "$(( ${HF_S:-170} - 10 ))" --out "$out" ${HF_ARGS:-}
want ring && step ring_sim2 "${RING_S:-90}" python3 benchmarks/ring_scaling.py --simulate 2 \
  --seqlens 32768 131072 --reps 3 --check-seqlen 4096 \
  --json "$out/ring_sim2.json" --markdown "$out/ring_sim2.md"

# FlashAttention's test grid through the API (96 cases x every exact backend; mostly JIT
# compiles, so on all cores): a step of its own, apart from the tests step's budget
fx=(); python3 -c "import xdist" 2>/dev/null && fx=(-n "${FAGRID_N:-14}")
want fagrid && step fagrid "${FAGRID_S:-480}" python3 -m pytest -m gpu tests/test_fa_grid_gpu.py -rs -v -v \
  -p no:cacheprovider "${fx[@]}"

# -- correctness, side by side ------------------------------------------------------------
say "start gpu_tests and kit in parallel"
( while sleep 30; do collect; done ) &  # pack their partial logs too, in case the run is cut
collector=$!
# the GPU tests are mostly JIT compiles (Triton, Gluon, FlashInfer): spread over processes
# when pytest-xdist was carried (pip download --no-deps -d .whl pytest-xdist execnet)
xdist=(); python3 -c "import xdist" 2>/dev/null && xdist=(-n "${TESTS_N:-4}")
# -v -v: one line per test (the project's addopts has -q), so a step cut by its timeout still
# says which tests finished
want tests && ( timeout "${TESTS_S:-230}" python3 -m pytest -m gpu ${TESTS_PATHS:-plugins tests --ignore=tests/test_fa_grid_gpu.py} -rs -v -v -p no:cacheprovider "${xdist[@]}" \
    > "$out/gpu_tests.txt" 2>&1; echo "gpu_tests rc=$?" >> "$out/gpu_tests.txt" ) &
want kit && ( timeout "${KIT_S:-200}" python3 -m attnhub check-plugin ${KIT_BACKENDS:---all-available} \
    --quick --budget "${KIT_BUDGET:-25}" --total "$(( ${KIT_S:-200} - 15 ))" > "$out/kit.txt" 2> "$out/kit.err"
  echo "kit rc=$?" >> "$out/kit.err" ) &
wait $(jobs -p | grep -vx "$collector")
kill "$collector" 2>/dev/null
want tests && say "end gpu_tests: $(tail -2 "$out/gpu_tests.txt" | tr '\n' ' ')"
want kit && say "end kit: $(tail -1 "$out/kit.err")"
tail -25 "$out/gpu_tests.txt" "$out/hf_generate.out" "$out/overhead.out" 2>/dev/null
grep -E "PASS|FAIL|CRASH" "$out/kit.txt" 2>/dev/null | grep -v "^|.*pass " | head -40
grep -B2 -A8 "attnhub adds" "$out/profile.out" 2>/dev/null
tail -25 "$out/regret/regret.md" 2>/dev/null
say "done"
collect
# beside results.tar.gz and session.log, at most 6 files come back (the device's limit is 8)
n=0
for f in session.log dprobe.json dprobe.out overhead.json probe.out dsweep.out peaked.out peaked.json null.out fp8api.out fp8api.json gap.out gap.json fagrid.out bwd.out bwd.json bwd.png fp8g.out gluon_ws.out gluon_ws.json grow.out grow_ragged.out pvf.out dho.out profile.out hf_generate.md ring_sim2.md gpu_tests.txt kit.txt \
    regret/regret.md regret/regret.png; do
  [[ -f "$out/$f" && $f != session.log && $n -lt 6 ]] && cp "$out/$f" "$final/" && n=$((n + 1))
done
