#!/usr/bin/env bash
# Every GPU benchmark in sequence, each under its own time limit (≈ 9 min in all), into one
# results folder; then the table of every target vs measured (bench/summary.py).
#
#   bash bench/run_all.sh [RESULTS_DIR] [NAME ...]     (make bench = all, bench/results/latest)
#
# NAMEs pick a subset, in this order: ceilings lora_kernels model_decode lora_decode_overhead
# lora_slot_load serve_offline_r16 serve_online serve_offline_r64, then the variants (not in
# the ≈ 9 min of a plain run; name them): serve_offline_noroute (adapters off the routed
# experts), serve_offline_resident (each scenario's adapters in GPU slots before its clock
# starts), serve_offline_fp8 (routed experts FP8 block-quantized), serve_cold_idle
# (cold-adapter probes on an idle engine), model_decode_fp8, grouped_gemm_tiles (expert GEMM
# tile plans at prefill shapes), copy_contention (a step's copy beside a slot load),
# serve_offline_profile (profiler windows inside serving), moe_lora_prefill (the MoE stage
# with LoRA after the grouped GEMM vs in its epilogue), serve_offline_host_profile (cProfile
# windows: where a step's host time goes), mla_prefill (one-launch prefill attention vs
# torch SDPA per sequence), grouped_gemm_decode (expert GEMM tile plans at decode batches,
# weight bandwidth vs copy bandwidth), triton_launch (host µs per Triton launch: the
# public call, Triton's JIT launch, kernels.launch's FastLaunch, the compiled kernel), model_decode_fp8_a8 and
# serve_offline_fp8_a8 (FP8 experts with e4m3 activations), moe_routing (expert selection:
# torch ops vs one launch). A benchmark cut off by its
# limit keeps what it wrote (the serving ones rewrite their JSON after every scenario and
# skip scenarios that would not fit: --time-budget). Logs: RESULTS_DIR/NAME.log.
# Limits (s) can be changed per benchmark: LIMIT_<NAME>=300 bash bench/run_all.sh DIR NAME.
set -u
OUT=${1:-bench/results/latest}
shift $(( $# > 0 ? 1 : 0 ))
WANTED=" $* "
PY=${GPU_PY:-python3}
mkdir -p "$OUT"
START=$(date +%s)
for name_limit in ceilings:30 lora_kernels:50 model_decode:50 lora_decode_overhead:45 \
    lora_slot_load:45 serve_offline_r16:140 serve_online:120 serve_offline_r64:50 \
    model_decode_fp8:60 serve_offline_fp8:140 serve_offline_noroute:130 serve_offline_resident:130 \
    serve_cold_idle:100 \
    grouped_gemm_tiles:120 copy_contention:60 serve_offline_profile:300 moe_lora_prefill:90 \
    serve_offline_host_profile:240 mla_prefill:60 grouped_gemm_decode:90 triton_launch:60 \
    model_decode_fp8_a8:60 serve_offline_fp8_a8:140 moe_routing:60; do
  var="LIMIT_${name_limit%%:*}"
  declare "$var=${!var:-${name_limit##*:}}"
done

VARIANTS=" model_decode_fp8 serve_offline_fp8 serve_offline_noroute serve_offline_resident "
VARIANTS+=" serve_cold_idle "
VARIANTS+=" grouped_gemm_tiles copy_contention serve_offline_profile moe_lora_prefill "
VARIANTS+=" serve_offline_host_profile mla_prefill grouped_gemm_decode triton_launch "
VARIANTS+=" model_decode_fp8_a8 serve_offline_fp8_a8 moe_routing "

run() {  # run NAME LIMIT_S MODULE ARGS...
  local name=$1 limit=$2
  shift 2
  if [[ "$WANTED" == "  " && "$VARIANTS" == *" $name "* ]]; then return; fi
  if [[ "$WANTED" != "  " && "$WANTED" != *" $name "* ]]; then return; fi
  local began=$(date +%s)
  echo "== $name (limit ${limit} s)"
  timeout -k 10 "$limit" "$PY" -m "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "   rc $rc, $(( $(date +%s) - began )) s$([[ $rc == 124 ]] && echo ' (time limit: partial results)')"
  tail -n 12 "$OUT/$name.log" | sed 's/^/   | /'
}

run ceilings "$LIMIT_ceilings" bench.ceilings --out "$OUT/ceilings.json"
run lora_kernels "$LIMIT_lora_kernels" bench.lora_kernels --targets --out "$OUT/lora_kernels.json"
run model_decode "$LIMIT_model_decode" bench.model_decode --json "$OUT/model_decode.json" \
  --plot "$OUT/model_decode.png" --batch-sizes 1 64 256
run lora_decode_overhead "$LIMIT_lora_decode_overhead" bench.lora_decode_overhead --out "$OUT/lora_decode_overhead.json"
run lora_slot_load "$LIMIT_lora_slot_load" bench.lora_slot_load --out "$OUT/lora_slot_load.json" --reps 5
run serve_offline_r16 "$LIMIT_serve_offline_r16" bench.serve_offline --rank 16 \
  --out "$OUT/serve_offline_r16.json" --time-budget $(( LIMIT_serve_offline_r16 - 15 ))
run serve_online "$LIMIT_serve_online" bench.serve_online --rank 16 --out "$OUT/serve_online.json" \
  --rates 4 16 --duration 10 --probes 6
run serve_offline_r64 "$LIMIT_serve_offline_r64" bench.serve_offline --rank 64 \
  --out "$OUT/serve_offline_r64.json" --time-budget $(( LIMIT_serve_offline_r64 - 10 )) --scenarios "no LoRA" "N=32 uniform" "N=8 zipf" "N=1000 zipf"

GOALS=("no LoRA" "N=32 uniform" "N=8 zipf" "N=1000 zipf")
run serve_offline_noroute "$LIMIT_serve_offline_noroute" bench.serve_offline --rank 16 \
  --adapter-modules no-routed --out "$OUT/serve_offline_noroute.json" \
  --time-budget $(( LIMIT_serve_offline_noroute - 15 )) --scenarios "${GOALS[@]}"
run serve_offline_resident "$LIMIT_serve_offline_resident" bench.serve_offline --rank 16 --resident \
  --out "$OUT/serve_offline_resident.json" --time-budget $(( LIMIT_serve_offline_resident - 15 )) \
  --scenarios "${GOALS[@]}"
run serve_offline_fp8 "$LIMIT_serve_offline_fp8" bench.serve_offline --rank 16 --experts fp8 \
  --out "$OUT/serve_offline_fp8.json" --time-budget $(( LIMIT_serve_offline_fp8 - 15 )) --scenarios "${GOALS[@]}"
run serve_cold_idle "$LIMIT_serve_cold_idle" bench.serve_online --rank 16 --out "$OUT/serve_cold_idle.json" \
  --rates --cold-rate 0 --probes 8 --probe-interval 0.5 --adapters 4
run model_decode_fp8 "$LIMIT_model_decode_fp8" bench.model_decode --experts fp8 \
  --json "$OUT/model_decode_fp8.json" --plot "$OUT/model_decode_fp8.png" --batch-sizes 1 64 256
run grouped_gemm_tiles "$LIMIT_grouped_gemm_tiles" bench.grouped_gemm_tiles \
  --out "$OUT/grouped_gemm_tiles.json"
run copy_contention "$LIMIT_copy_contention" bench.copy_contention --out "$OUT/copy_contention.json"
run serve_offline_profile "$LIMIT_serve_offline_profile" bench.serve_offline --rank 16 \
  --out "$OUT/serve_offline_profile.json" --profile-steps 3 \
  --scenarios "no LoRA" "N=32 uniform" "N=1 uniform"

run moe_lora_prefill "$LIMIT_moe_lora_prefill" bench.moe_lora_prefill \
  --out "$OUT/moe_lora_prefill.json"
run serve_offline_host_profile "$LIMIT_serve_offline_host_profile" bench.serve_offline --rank 16 \
  --out "$OUT/serve_offline_host_profile.json" --profile-steps 3 --profile-kind host \
  --scenarios "no LoRA" "N=32 uniform"
run mla_prefill "$LIMIT_mla_prefill" bench.mla_prefill --out "$OUT/mla_prefill.json"
run grouped_gemm_decode "$LIMIT_grouped_gemm_decode" bench.grouped_gemm_tiles --decode \
  --out "$OUT/grouped_gemm_decode.json"
run triton_launch "$LIMIT_triton_launch" bench.triton_launch --out "$OUT/triton_launch.json"
run model_decode_fp8_a8 "$LIMIT_model_decode_fp8_a8" bench.model_decode --experts fp8_a8 \
  --json "$OUT/model_decode_fp8_a8.json" --plot "$OUT/model_decode_fp8_a8.png" --batch-sizes 1 64 256
run serve_offline_fp8_a8 "$LIMIT_serve_offline_fp8_a8" bench.serve_offline --rank 16 --experts fp8_a8 \
  --out "$OUT/serve_offline_fp8_a8.json" --time-budget $(( LIMIT_serve_offline_fp8_a8 - 15 )) \
  --scenarios "${GOALS[@]}"
run moe_routing "$LIMIT_moe_routing" bench.moe_routing --out "$OUT/moe_routing.json"

echo "== all done in $(( $(date +%s) - START )) s; results in $OUT"
"$PY" -m bench.summary "$OUT"
