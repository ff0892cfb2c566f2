#!/usr/bin/env bash
# Issue 15's GPU session, one command, every step bounded in time, results under $OUT:
#   1. measure the standard grid with the default policy and no profile (the "before"), and
#      write the shipped profile pack from the forced timings (nvidia-h200.json);
#   2. put the pack in place (attnhub/profiles/) and measure the grid again: the regret report
#      (regret.md / regret.json / regret.png);
#   3. benchmarks/overhead.py --walks: host cost of attnhub over the bound backend called
#      directly (fixed shapes, and a new length per call);
#   4. benchmarks/sdpa_thd.py: torch_sdpa's loop-free thd paths vs the per-document loop
#      (thd_paths.md / thd_paths.json; skip with THD=0).
# The regret report times the policy's call, every forced backend and the raw libraries
# (SDPA, torch's varlen op, FA3) in turn within each repeat (see attnhub/regret.py).
# FlashInfer and Flex are excluded from the grid (see docs/benchmarks/regret_h200.md):
# FlashInfer compiles ~90 s per kernel on first use, Flex compiles per shape, and the
# default policy binds neither for these cells (flex only for score_mod/mask_mod calls).
# Usage on the H200 (wheels carried in .whl): COMMIT=abc1234 bash benchmarks/regret_session.sh
# (ROUNDS: timing rounds per cell, min of medians, default 3: a host-bound cell of ~50 us
# once timed 1.08 of the same backend forced with 2; a round costs little beside the checks)
# CPU dry run: DRY=1 bash benchmarks/regret_session.sh (its pack goes to $out/packs, never
# over the shipped attnhub/profiles/nvidia-h200.json)
set -uo pipefail
out=${OUT:-out/regret_session}
mkdir -p "$out"
log="$out/session.log"
start=$(date +%s)
budget=${BUDGET_S:-400}
left() { echo $(( budget - ($(date +%s) - start) )); }
cap() { local want=$1 l; l=$(left); (( l < want )) && want=$l; (( want < 5 )) && want=5; echo "$want"; }
say() { echo "[$(( $(date +%s) - start ))s] $*" | tee -a "$log"; }

root=$(pwd)
if [[ -z "${DRY:-}" ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >> "$log" 2>&1
fi
export PYTHONPATH=/tmp/site:$root:$root/plugins/triton_portable:$root/plugins/sm80_fa2:$root/plugins/sm90_fa3:$root/plugins/hybrid_linear:$root/plugins/ring:$root/plugins/rocm
export ATTNHUB_PLUGIN_MODULES=attnhub_triton_portable.plugin,attnhub_sm80_fa2.plugin,attnhub_sm90_fa3.plugin,attnhub_hybrid_linear.plugin,attnhub_ring.plugin,attnhub_rocm.plugin
export PYTHONUNBUFFERED=1 ATTNHUB_PROFILE=/tmp/attnhub_empty_profile.json
rm -f "$ATTNHUB_PROFILE"
{ date -u +%FT%TZ; echo "commit ${COMMIT:-?}"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1; } >> "$log"
say "setup done"

common=(bench --regret --no-store --exclude "${EXCLUDE:-flashinfer_decode,flashinfer_prefill,flex}"
        --header "commit ${COMMIT:-?}" --warmup 3 --repeats "${REPEATS:-30}" --rounds "${ROUNDS:-3}")
if [[ -n "${DRY:-}" ]]; then common+=(--backends torch_sdpa --scale 256 --repeats 2 --rounds 1 --warmup 1); fi

packdir=attnhub/profiles
if [[ -n "${DRY:-}" ]]; then
  packdir="$out/packs"; mkdir -p "$packdir"; export ATTNHUB_PROFILE_PACKS="$packdir"
fi
pack=$packdir/${PACK:-nvidia-h200}.json
# SKIP_STEP1=1: no "before" grid; step 2 runs with the pack as shipped (measured on this
# machine image by an earlier run at a commit whose bindings this one keeps)
# STEP1_CELLS: measure only these cells in step 1 and merge the pack with PACK_FROM (a pack
# of the other cells from an earlier run on the same machine image), to save device time.
step1=()
[[ -n "${STEP1_CELLS:-}" ]] && step1=(--cells "$STEP1_CELLS")
if [[ -z "${SKIP_STEP1:-}" ]]; then
rm -f "$pack"
say "step 1: grid before (no profile, no pack), writing the pack"
ATTNHUB_PROFILE_PACKS=off timeout "$(cap "${STEP1_S:-260}")" python3 -m attnhub "${common[@]}" "${step1[@]}" \
  --out-json "$out/regret_before.json" --pack "$out/${PACK:-nvidia-h200}.json" \
  > "$out/before.txt" 2>> "$log"
say "step 1 rc=$?"; tail -30 "$out/before.txt" >> "$log"
if [[ -n "${PACK_FROM:-}" ]]; then
  python3 - "$PACK_FROM" "$out/${PACK:-nvidia-h200}.json" >> "$log" 2>&1 <<'PY'
import json, sys
old, new = (json.load(open(p)) for p in sys.argv[1:3])
for key, entry in new["devices"].items():
    speed = old["devices"].get(key, {}).get("speed", {})
    print("merge: earlier pack has", len(speed), "buckets for this device;",
          "this run", len(entry["speed"]))
    entry["speed"] = {**speed, **entry["speed"]}
new["pack"]["merged_from"] = old["pack"]
json.dump(new, open(sys.argv[2], "w"), indent=2, sort_keys=True)
PY
fi
cp "$out/${PACK:-nvidia-h200}.json" "$pack" 2>> "$log"
else
  say "step 1 skipped (SKIP_STEP1): the shipped pack $(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['pack']['commit'])" "$pack" 2>&1)"
fi

say "step 2: regret report with the pack in place"
timeout "$(cap "${STEP2_S:-170}")" python3 -m attnhub "${common[@]}" "${step1[@]}" \
  --out-json "$out/regret.json" --md "$out/regret.md" --plot "$out/regret.png" >> "$log" 2>&1
say "step 2 rc=$?"

say "step 3: host overhead"
calls=${OVERHEAD_CALLS:-5000}; [[ -n "${DRY:-}" ]] && calls=5
walks=(--walks); [[ -n "${DRY:-}" ]] && walks=(--walks --scale 64)
timeout "$(cap "${OVERHEAD_S:-130}")" python3 benchmarks/overhead.py --json --calls "$calls" \
  --rounds 3 "${walks[@]}" > "$out/overhead.json" 2>> "$log"
say "step 3 rc=$?"
cat "$out/overhead.json" >> "$log"
if [[ "${THD:-1}" != 0 ]]; then
  say "step 4: torch_sdpa thd paths (loop-free vs per-document loop)"
  thd=(); [[ -n "${DRY:-}" ]] && thd=(--cpu)
  timeout "$(cap 90)" python3 benchmarks/sdpa_thd.py "${thd[@]}" --json "$out/thd_paths.json" \
    > "$out/thd_paths.md" 2>> "$log"
  say "step 4 rc=$?"; cat "$out/thd_paths.md" >> "$log"
fi
if [[ -n "${REST_CELLS:-}" ]]; then  # the other cells again, with the merged pack, as time allows
  say "step 5: regret report, cells $REST_CELLS"
  timeout "$(cap 170)" python3 -m attnhub "${common[@]}" --cells "$REST_CELLS" \
    --out-json "$out/regret_rest.json" >> "$log" 2>&1
  say "step 5 rc=$?"
fi
rm -f "$out/before.txt"
say "done"
