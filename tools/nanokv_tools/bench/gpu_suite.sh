#!/usr/bin/env bash
# One device call that checks and times everything the GPU benchmarks measure.
#   bash tools/nanokv_tools/bench/gpu_suite.sh [profile] [parity] [kernels] [nanovllm] [longctx] [quant] [hf] [pool] [ncu]
#                                  [pairs] [rotab] [breakdown] [variants] [hostprof] [swap4] [int4next]
#                                  [ipc] [split] [splitlong] [splitadapt] [repoolprobe] [sparsity] [spprofile] [spstore] [router] [tiers] [tierbw]
# sparsity: block sparsity while serving (gpu_sparsity, SPOPT sparsity_options, default probe_window=32): 128
# longctx sequences for int8 / attention / hybrid; the same at an equal batch cap (EQUAL, default 24); hybrid with
# long32k (LONGN sequences, default 8) for int8 and hybrid; spstore: hybrid with store_fraction=1.0;
# spprofile: int8 and hybrid at the equal batch under torch.profiler (steps PSTEPS, default 600:700);
# router: two replicas behind the router at RATES (default 8,12), kv against round-robin;
# tierbw: the host tier's load / write-back time per tier format (pool, int8, int4), Llama-3-8B layout;
# tiers: the hierarchy at TIER_RATES (default 4,5): L1, L1+L2, L1+L2(int8), L1+L2+L3 in one process, L1+L2 split
# ipc: the CUDA IPC tests and GPU parity through the three services (fp32 == CPU reference, bf16 split ==
# bf16 in-process); split: the nanovllm workload through the services and in-process, side by side;
# (REPEAT=n: n pairs, each in its own process);
# splitlong: the long-context workload through the services in bf16, int8 and int4 (the ratios);
# splitadapt: the adaptive controller through the services (pool grow/shrink and KV-width back-off over
# CUDA IPC, a policy switch over RPC: nanokv_tools.bench.gpu_adaptive_split), then the nanovllm workload with
# the controller on, through the services and in-process side by side;
# pairs: int8 then bf16 on the long-context workload, PAIRS times (the int8 / bf16 ratio, same machine);
# rotab: int8 with TritonConfig.qk_rotation_in_rope on, then off, PAIRS times; breakdown: run_breakdown
# of int8 and bf16 with host ops (the longest idle gaps and what overlaps them); variants: the int8
# long-context run once per VARIANTS entry ("name=KERNEL_OPTIONS", space-separated), e.g.
# VARIANTS="rot_off=qk_rotation_in_rope=0";
# hostprof: host time of the int8 run's prefill phase (nanokv_tools.bench.host_profile)
# Results: $OUT/*.json and $OUT/suite.log; a summary table is printed last.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# the tools are their own distribution (tools/): on the bare device machine they run from the checkout
export PYTHONPATH="$PWD:$PWD/tools${PYTHONPATH:+:$PYTHONPATH}"
LOG="$OUT/suite.log"
phases=${*:-parity kernels nanovllm longctx quant}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee -a "$LOG"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG"
BENCH="python3 -m nanokv_tools.bench.cli --max-num-batched-tokens 16384"  # (no install there: no entry points)
run() {  # name, command...
  local name=$1; shift
  echo "=== $name: $*" | tee -a "$LOG"
  local t0=$SECONDS
  "$@" >>"$LOG" 2>&1; local rc=$?
  echo "=== $name rc=$rc $((SECONDS - t0))s" | tee -a "$LOG"
  grep -E "^\[|tok/s|floor|parity|speedup|Error|error" "$LOG" | tail -n 6
}
for ph in $phases; do
  case $ph in
    profile)
      run profile python3 -m nanokv_tools.bench.gpu_profile ;;
    parity) run parity python3 -m nanokv_tools.bench.gpu_parity --out "$OUT/parity.json" ;;
    pool) run pool python3 -m nanokv_tools.bench.gpu_pool --out "$OUT/pool.json" ;;
    kernels) run kernels python3 -m nanokv_tools.bench.gpu_kernels --out "$OUT" --budget ${KERNEL_BUDGET:-120} \
      --sweep-bits ${SWEEP_BITS:-16,8,4} ;;
    nanovllm) run nanovllm $BENCH --workload nanovllm --out "$OUT/nanovllm.json" ;;
    longctx) run longctx_bf16 $BENCH --workload longctx --out "$OUT/longctx_bf16.json" ;;
    quant)
      run longctx_int8 $BENCH --workload longctx --enable-compression --quantization-bitwidth 8 \
        --out "$OUT/longctx_int8.json"
      run longctx_int4 $BENCH --workload longctx --enable-compression --quantization-bitwidth 4 \
        --out "$OUT/longctx_int4.json" ;;
    ncu)  # Nsight Compute of one decode call per format (64 x 4096): stall reasons, memory, SASS
      for b in 16 8 4; do
        run ncu_$b ncu --clock-control none --set full --import-source yes -k regex:"_decode_kernel|decode_int4" \
          --launch-skip 2 --launch-count 1 -f -o "$OUT/ncu_$b" python3 -m nanokv_tools.bench.decode_probe --bits $b
        ncu --import "$OUT/ncu_$b.ncu-rep" --page details > "$OUT/ncu_${b}_details.txt" 2>&1
        ncu --import "$OUT/ncu_$b.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_${b}_sass.csv" 2>&1
      done ;;
    hf) run hf $BENCH --workload nanovllm --compare hf --num-seqs 64 --out "$OUT/nanovllm_hf64.json" ;;
    pairs)
      for i in $(seq "${PAIRS:-2}"); do
        run pair${i}_int8 $BENCH --workload longctx --enable-compression --quantization-bitwidth 8 \
          --out "$OUT/pair${i}_int8.json"
        run pair${i}_bf16 $BENCH --workload longctx --out "$OUT/pair${i}_bf16.json"
      done ;;
    rotab)
      for i in $(seq "${PAIRS:-2}"); do
        run rot${i}_on $BENCH --kernel-options qk_rotation_in_rope=1 --workload longctx --enable-compression \
          --quantization-bitwidth 8 --out "$OUT/rot${i}_on.json"
        run rot${i}_off $BENCH --kernel-options qk_rotation_in_rope=0 --workload longctx --enable-compression --quantization-bitwidth 8 \
          --out "$OUT/rot${i}_off.json"
      done ;;
    variants)
      for v in ${VARIANTS:-}; do
        run var_${v%%=*} $BENCH --kernel-options "${v#*=}" --workload longctx --enable-compression --quantization-bitwidth 8 \
          --out "$OUT/var_${v%%=*}.json"
      done ;;
    swap4)  # the transposed int4 decode (TritonConfig.quant_swap4): GPU tests, per-call A/B, whole runs
      run swap4_tests python3 -m pytest -q tests/kernels/test_kernels_cuda.py tests/kernels/test_kernels_attention.py tests/kernels/test_kernels_blockquant.py \
        tests/compute_service/test_fusion.py -k "swap or int4 or 4- or blockquant or fill"
      PROBE="python3 -m nanokv_tools.bench.decode_probe --bits 4 --batch 128 --ctx 4096 --engine-like --time"
      run probe4_bs16 $PROBE --block-size 16 --variants "${PROBE16:-}"
      run probe4_bs32 $PROBE --block-size 32 --variants "${PROBE32:-}"
      for v in ${SWAP4_RUNS:-"s16::16"}; do  # name:kernel options:block size; names bf16* = 16-bit runs
        IFS=: read -r name tcfg bs <<< "$v"
        if [[ $name == bf16* ]]; then run e2e_$name $BENCH --workload longctx --out "$OUT/e2e_$name.json"; continue; fi
        run e2e_$name $BENCH --kernel-options "$tcfg" --workload longctx --enable-compression \
          --quantization-bitwidth 4 --block-size $bs --out "$OUT/e2e_$name.json"
      done
      [ -n "${BREAKDOWN4:-}" ] && run breakdown_4 python3 -m nanokv_tools.bench.run_breakdown --workload longctx --bits 4 \
        --out "$OUT/breakdown_4.json"
      run e2e_int8 $BENCH --workload longctx --enable-compression --quantization-bitwidth 8 --out "$OUT/e2e_int8.json" ;;
    int4next)  # the CUDA int4 kernel's GPU tests, its knobs at 32-token blocks, an Nsight Compute stall
      # profile of its loop (nanokv_tools.bench.ncu_stalls), and int4/bf16 pairs at the default block size
      # (auto: int4 32, bf16 16) and at 32 for both
      run int4_tests python3 -m pytest -q tests/kernels/test_kernels_cuda.py
      PROBE="python3 -m nanokv_tools.bench.decode_probe --bits 4 --batch 128 --ctx 4096 --engine-like --shuffle"
      run probe4_bs32 $PROBE --time --block-size 32 --variants \
        ";quant_cuda4_stages=3;quant_cuda4_waves=3;quant_cuda4_waves=2;quant_cuda4_maxnreg=128;quant_cuda4_tiles=1"
      run ncu_4 ncu --clock-control none --set full --import-source yes -k regex:"decode_int4" --launch-skip 2 \
        --launch-count 1 -f -o "$OUT/ncu_4" $PROBE --block-size 32 --calls 3
      ncu --import "$OUT/ncu_4.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_4_sass.csv" 2>&1
      python3 -m nanokv_tools.bench.ncu_stalls "$OUT/ncu_4_sass.csv" --top 20 | tee -a "$LOG"
      for i in $(seq "${PAIRS:-2}"); do
        run pair${i}_int4 $BENCH --workload longctx --enable-compression --quantization-bitwidth 4 \
          --out "$OUT/pair${i}_int4.json"
        run pair${i}_bf16 $BENCH --workload longctx --out "$OUT/pair${i}_bf16.json"
        run pair${i}_bf16_32 $BENCH --workload longctx --block-size 32 --out "$OUT/pair${i}_bf16_32.json"
      done ;;
    ipc)
      run ipc_tests python3 -m pytest -q -p no:cacheprovider tests/kv/test_cuda_ipc.py
      run parity_split python3 -m nanokv_tools.bench.gpu_parity --split --out "$OUT/parity_split.json" ;;
    split)  # each pair in a fresh process (an in-process engine's pool is not all given back before exit)
      for i in $(seq "${REPEAT:-1}"); do
        run nanovllm_split$i $BENCH --workload nanovllm --transport both --out "$OUT/nanovllm_split$i.json"
      done ;;
    repoolprobe)  # does a bf16 repool depend on what the engine served before? (graphs on/off, histories)
      run repool_probe python3 -m nanokv_tools.bench.repool_probe --out "$OUT/repool_probe.json" ;;
    splitadapt)
      run adaptive_split python3 -m nanokv_tools.bench.gpu_adaptive_split --out "$OUT/adaptive_split.json"
      run nanovllm_split_adaptive $BENCH --workload nanovllm --transport both --adaptive \
        --out "$OUT/nanovllm_split_adaptive.json" ;;
    splitlong)
      run longctx_split_bf16 $BENCH --workload longctx --transport split --out "$OUT/longctx_split_bf16.json"
      run longctx_split_int8 $BENCH --workload longctx --transport split --enable-compression \
        --quantization-bitwidth 8 --out "$OUT/longctx_split_int8.json"
      run longctx_split_int4 $BENCH --workload longctx --transport split --enable-compression \
        --quantization-bitwidth 4 --out "$OUT/longctx_split_int4.json" ;;
    sparsity)
      SP="python3 -m nanokv_tools.bench.gpu_sparsity --skip-kernels --sparsity-options ${SPOPT:-probe_window=32}"
      run sp_window timeout 200 $SP --workloads longctx --num-seqs 128 --configs int8,attention,hybrid \
        --out "$OUT/sp_window"
      run sp_equal timeout 150 $SP --workloads longctx --num-seqs 128 --max-num-seqs ${EQUAL:-24} --configs int8,hybrid \
        --out "$OUT/sp_equal"
      run sp_long timeout 230 $SP --workloads long32k --long-num-seqs ${LONGN:-8} --configs int8,hybrid \
        --out "$OUT/sp_long" ;;
    spprofile)  # where hybrid's time goes at an equal batch: torch.profiler over 100 steps of each run
      run sp_profile timeout 300 python3 -m nanokv_tools.bench.gpu_sparsity --skip-kernels --workloads longctx \
        --num-seqs 128 --max-num-seqs ${EQUAL:-24} --configs int8,hybrid --profile-steps ${PSTEPS:-600:700} \
        --out "$OUT/sp_profile" ;;
    spstore)
      run sp_store timeout 100 python3 -m nanokv_tools.bench.gpu_sparsity --skip-kernels --workloads longctx \
        --num-seqs 128 --configs hybrid --sparsity-options "${SPOPT:-probe_window=32},store_fraction=1.0" \
        --out "$OUT/sp_store" ;;
    router)
      run router timeout 330 python3 -m nanokv_tools.bench.gpu_router --out "$OUT/router.json" --num-prompts 96 \
        --rate ${RATES:-8,12} ;;
    tierbw)  # the host tier's loads and write-backs per format: bytes (pool) and re-quantized (int8, int4)
      run tierbw timeout 300 python3 -m nanokv_tools.bench.gpu_tiers --out "$OUT/tierbw.json" --configs '' \
        --bandwidth-formats pool,int8,int4 ;;
    tiers)
      run tiers timeout 560 python3 -m nanokv_tools.bench.gpu_tiers --out "$OUT/tiers.json" --skip-bandwidth \
        --l1-blocks 2048 --l2-gib 32 --l3-gib 32 --system-len 6144 --user-len 256 --output-len 64 --num-prompts 64 \
        --turns 4 --systems 16 --rate ${TIER_RATES:-4,5} --max-num-seqs 8 \
        --configs "${TIER_CONFIGS:-L1,L1+L2,L1+L2(int8),L1+L2+L3}" --up-configs "${TIER_UP:-L1+L2}" ;;
    hostprof) run hostprof_8 python3 -m nanokv_tools.bench.host_profile --bits 8 --out "$OUT/hostprof_8.json" ;;
    breakdown)
      for b in 8 16; do
        run breakdown_$b python3 -m nanokv_tools.bench.run_breakdown --workload longctx --bits $b --host \
          --out "$OUT/breakdown_$b.json"
      done ;;
  esac
done
echo "===== summary" | tee -a "$LOG"
grep -hE "^\[|achieved|HF|parity" "$LOG" | tail -n 30
