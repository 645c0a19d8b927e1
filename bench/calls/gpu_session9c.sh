#!/usr/bin/env bash
# H200 call 3 of session 9 (2026-12-01): the probe again with both forms of mHC's mixes compiled (call 2 ran them
# eager, which says little about the compiled layers), then tests/test_compile.py on the GPU (inductor: compiled
# training, CUDA graphs, decode, sampler, the GRPO losses). Output: $OUT/log*.txt
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind/inductor TRITON_CACHE_DIR=/tmp/ind/triton
O=${OUT:-/tmp}
mkdir -p /tmp/ind
drop() { grep -v "Loading weights" | grep -v -i "warn\|online softmax\|split the\|important use case\|softmax\.$\|^$\|originates\|rope_inv_freq\|^ *\^*$\|File \"/work\|^E1201"; }
{ nvidia-smi -L; git log -1 --oneline; git status --short | head; } > $O/log.txt
( date +%T; timeout 150 python bench/probe_hc_loss.py 2>&1 | drop; date +%T ) > $O/log_probe.txt 2>&1
( date +%T; timeout 400 python -m pytest -v -p no:cacheprovider tests/test_compile.py::test_compiled_grpo_losses_equal_eager tests/test_compile.py::test_compiled_sampler_and_sinkhorn_equal_eager tests/test_compile.py::test_compile_layers_decode_as_close_as_eager tests/test_compile.py::test_compile_layers_train_as_accurate_as_eager tests/test_compile.py::test_compile_graphs_equal_compiled_step_after_step 2>&1 | grep -E "PASSED|FAILED|Error|passed|failed" | tail -12; date +%T ) > $O/log_test.txt 2>&1
cat $O/log.txt $O/log_probe.txt $O/log_test.txt
