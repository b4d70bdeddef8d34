# session 18 call 3: coalesced copy as the default; GPU tests, probe sweep of the rest, e2e pairs, breakdown
export PATH=/usr/local/cuda/bin:$PATH PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
R=$OUT/r; mkdir -p $R
python3 -m pytest -q tests/test_kernels_cuda.py > $R/tests.log 2>&1; tail -2 $R/tests.log
PROBE="python3 -m nanokv.bench.decode_probe --bits 4 --batch 128 --ctx 4096 --engine-like --shuffle --block-size 32"
V=";quant_cuda4_variant=1;quant_cuda4_variant=4;quant_cuda4_variant=2;quant_cuda4_variant=16;quant_cuda4_variant=64"
V="$V;quant_cuda4_variant=8,quant_cuda4_stages=3;quant_cuda4_stages=3;quant_cuda4_waves=3;quant_cuda4_waves=2"
V="$V;quant_cuda4_variant=65;quant_cuda4_tiles=1;"
$PROBE --time --variants "$V" > $R/probe32.log 2>&1
grep -E "us |relative" $R/probe32.log
BEST=$(python3 -c "
import re
best=min(((float(m.group(2)),m.group(1)) for m in re.finditer(r'\[(.*?)\]: ([0-9.]+) us', open('$R/probe32.log').read())), default=(0,''))
print(best[1])")
echo "best: $BEST"
BENCH="python3 -m nanokv.cli bench --max-num-batched-tokens 16384 --workload longctx"
for i in 1 2; do
  $BENCH --enable-compression --quantization-bitwidth 4 --out $R/pair${i}_int4.json > $R/pair${i}_int4.log 2>&1; grep "tok/s" $R/pair${i}_int4.log | head -1
  $BENCH --out $R/pair${i}_bf16.json > $R/pair${i}_bf16.log 2>&1; grep "tok/s" $R/pair${i}_bf16.log | head -1
done
[ -n "$BEST" ] && NANOKV_TRITON=$BEST $BENCH --enable-compression --quantization-bitwidth 4 --out $R/i4best.json > $R/i4best.log 2>&1 && grep "tok/s" $R/i4best.log | head -1
python3 -m nanokv.bench.run_breakdown --workload longctx --bits 4 --out $R/bd4.json > $R/bd4.log 2>&1; grep -A8 "^\[longctx" $R/bd4.log
cd $OUT && tar czf r.tgz r && rm -rf r
