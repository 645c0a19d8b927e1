#!/usr/bin/env bash
# Session 22, call 2: MoE's row moves with gathers both ways (model_dsv4.Picks / PickSum) and hc_post's forward a
# token a program; the groups of call 1 taken out. The kernel and Triton tests on the GPU, the row moves alone
# (bench/probe_combine.py), then the training step at 1 x 4096 with its trace, summed; and the generated source of
# the attention output's inverse-RoPE kernel (call 1: 139 us in the CSA and window layers, 20 us in the HCA ones).
# Output: $OUT/log.txt, results.txt, trace1.json.xz, rope_kernels.txt
source bench/calls/prelude.sh
step tests 100 python -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_triton.py
step combine 60 python bench/probe_combine.py
step train1 230 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=6 --warmup=2 --compile=graphs --profile --trace=$O/trace1.json
step summary 40 python bench/trace_summary.py $O/trace1.json --top=30
for f in $(grep -rl "def triton_poi_fused__to_copy_add_arange_cat_cos_mul_slice_stack_sub_unsqueeze_view" /tmp/ind/inductor | head -3); do
  echo "== $f"; grep -B14 -A45 "def triton_poi_fused__to_copy_add_arange_cat_cos_mul_slice_stack_sub_unsqueeze_view" "$f" | head -120
done > $O/rope_kernels.txt 2>&1
cd $O && cat log.txt tests.txt combine.txt summary.txt train1.txt > results.txt && xz -T4 trace1.json; tar c *.raw | xz > logs.tar.xz && rm -f *.raw tests.txt combine.txt train1.txt
grep -v "^ *$" results.txt | grep -v "^ *-\+" | grep -v "^ *## Call\|^ *nvjet\|^ *triton_\|Memset\|^ *aten::\|^ *void \|^ *cuda\|^ *Cuda\|^ *_ZN" | head -70
