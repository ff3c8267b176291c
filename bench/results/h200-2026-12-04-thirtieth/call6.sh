export TRITON_DEFAULT_FP_FUSION=1
python3 .probe/plan_ab.py > $OUT/plan-ab.txt 2>&1; tail -45 $OUT/plan-ab.txt
