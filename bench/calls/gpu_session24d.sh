#!/usr/bin/env bash
# Session 24, call 4: the sampler kernel and the batched admission: their GPU tests, then bench/probe_admit.py
# (each against the code it replaced, in the same run).
source bench/calls/prelude.sh
step tests 80 python -m pytest -q -p no:cacheprovider tests/test_triton.py -k "sample or experts or engine"
step admit 120 python bench/probe_admit.py
cd $O && cat log.txt tests.txt admit.txt > results.txt; rm -f *.raw
grep -v "^ *$" results.txt | tail -30
