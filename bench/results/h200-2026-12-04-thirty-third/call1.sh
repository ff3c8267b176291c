#!/bin/bash
export TRITON_DEFAULT_FP_FUSION=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
start=$(date +%s)
timeout 430 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu > $OUT/gpu-suite.txt 2>&1; echo "suite rc $? in $(( $(date +%s) - start )) s"
tail -3 $OUT/gpu-suite.txt
grep -E "^FAILED|^ERROR" $OUT/gpu-suite.txt | head -20
left=$(( 585 - ($(date +%s) - start) ))
# .probe/mirror_host.py: bench/results/h200-2026-12-04-thirty-second/mirror_host.py
if [ $left -gt 100 ]; then timeout $left python3 .probe/mirror_host.py > $OUT/mirror-host.txt 2>&1; echo "mirror rc $?"; cat $OUT/mirror-host.txt | tail -3; fi
