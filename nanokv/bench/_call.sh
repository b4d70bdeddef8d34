# session 18 call: GPU tests, probe sweep (variants + knobs), ncu stall profile, e2e pairs
export PATH=/usr/local/cuda/bin:$PATH PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm --format=csv > $R/smi.txt
python3 -m pytest -q tests/test_kernels_cuda.py > $R/tests.log 2>&1; tail -2 $R/tests.log
PROBE="python3 -m nanokv.bench.decode_probe --bits 4 --batch 128 --ctx 4096 --engine-like --shuffle --block-size 32"
$PROBE --time --variants ";quant_cuda4_variant=1;quant_cuda4_variant=4;quant_cuda4_variant=5;quant_cuda4_variant=2;quant_cuda4_variant=16;quant_cuda4_variant=23;quant_cuda4_variant=5,quant_cuda4_maxnreg=128;quant_cuda4_stages=3;quant_cuda4_waves=3;quant_cuda4_waves=2;quant_cuda4_maxnreg=128;quant_cuda4_variant=8,quant_cuda4_stages=3;quant_cuda4_variant=13,quant_cuda4_stages=3;quant_cuda4_variant=31,quant_cuda4_stages=3;quant_cuda4_variant=31,quant_cuda4_stages=4;" > $R/probe32.log 2>&1
grep -E "us |relative" $R/probe32.log
ncu --clock-control none --set full --import-source yes -k regex:"decode_int4" --launch-skip 2 --launch-count 1 -f -o $R/ncu_4 $PROBE --calls 3 > $R/ncu_run.log 2>&1
ncu --import $R/ncu_4.ncu-rep --page source --csv --print-source sass > $R/ncu_4_sass.csv 2>&1
ncu --import $R/ncu_4.ncu-rep --page details > $R/ncu_4_details.txt 2>&1
python3 -m nanokv.bench.ncu_stalls $R/ncu_4_sass.csv --top 25 > $R/ncu_4_stalls.txt 2>&1; head -30 $R/ncu_4_stalls.txt
rm -f $R/ncu_4.ncu-rep
BENCH="python3 -m nanokv.cli bench --max-num-batched-tokens 16384 --workload longctx"
$BENCH --enable-compression --quantization-bitwidth 4 --out $R/i4.json > $R/i4.log 2>&1; grep "tok/s" $R/i4.log | tail -1
BEST=$(python3 -c "
import re,sys
best=min(((float(m.group(2)),m.group(1)) for m in re.finditer(r'\[(.*?)\]: ([0-9.]+) us', open('$R/probe32.log').read())), default=(0,''))
print(best[1])")
echo "best: $BEST"
NANOKV_TRITON=$BEST $BENCH --enable-compression --quantization-bitwidth 4 --out $R/i4best.json > $R/i4best.log 2>&1; grep "tok/s" $R/i4best.log | tail -1
$BENCH --out $R/bf.json > $R/bf.log 2>&1; grep "tok/s" $R/bf.log | tail -1
cd $OUT && tar czf r.tgz r && rm -rf r
