export TRITON_DEFAULT_FP_FUSION=1; mkdir -p $OUT/np
timeout 400 python3 bench/policies.py --scale 0.0625 --turns 13 --trace model --policies --no-pressure-check --no-pressure-repeats 10 > $OUT/np/no-pressure-220.txt 2>&1; echo rc $?
tail -7 $OUT/np/no-pressure-220.txt
