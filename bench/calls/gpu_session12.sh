#!/usr/bin/env bash
# H200 call 1 of session 12 (2026-12-02): four pieces of a training layer, each against its alternative
# (bench/probe_layer.py), then the GPU tests: the kernels, the Sinkhorn op and compiled layers under inductor,
# CUDA IPC into a server (not run on the GPU since session 10). Output: $OUT/*.txt, *.raw
# It ran on a tree with the Sinkhorn op in kernels_torch.py and its test in tests/test_compile.py; both were taken out
# after this call (the op is kept in bench/probe_layer.py), so test_sinkhorn_op_gradient no longer exists.
source bench/calls/prelude.sh
step probe 330 python bench/probe_layer.py
step test 200 python -m pytest -q tests/test_kernels.py tests/test_tensor_sync.py::test_cuda_ipc_into_a_server_on_this_gpu \
    tests/test_compile.py::test_sinkhorn_op_gradient tests/test_compile.py::test_compiled_sampler_and_sinkhorn_equal_eager \
    tests/test_compile.py::test_compile_layers_train_as_accurate_as_eager
cat $O/log.txt $O/probe.txt; tail -15 $O/test.txt
