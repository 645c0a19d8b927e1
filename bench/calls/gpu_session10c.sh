#!/usr/bin/env bash
# H200 call 3 of session 10 (2026-12-02): call 2 ran out of time before its GRPO run printed anything (grep
# buffered its output); the GRPO run alone, fp32 toy model, compile='layers', weight_sync='tensor'.
source bench/calls/prelude.sh
( date +%T; timeout 270 python train_grpo.py --out_dir=/tmp/g10 --compile=layers --weight_sync=tensor --max_steps=3 \
    --format_warmup_steps=10 --eval_interval=0 --checkpoint_interval=0 2>&1 | grep --line-buffered -v -i "warn\|^$" \
    | cut -c1-200 > $O/log_grpo_full.txt; date +%T ) > $O/log_grpo.txt 2>&1
cat $O/log.txt $O/log_grpo.txt; head -20 $O/log_grpo_full.txt; echo ...; tail -25 $O/log_grpo_full.txt
