export TRITON_DEFAULT_FP_FUSION=1
python3 bench/results/h200-2026-12-04-thirty-first/plan_ab.py A W AW C WC AWC > $OUT/call5-plan-ab.txt 2>&1; echo rc $?
mkdir -p $OUT/np
timeout 330 python3 bench/policies.py --scale 0.0625 --turns 13 --trace model --policies --no-pressure-check --no-pressure-repeats 8 > $OUT/np/no-pressure.txt 2>&1; echo rc $?
grep -A6 "^no pressure" $OUT/np/no-pressure.txt
tail -17 $OUT/call5-plan-ab.txt
