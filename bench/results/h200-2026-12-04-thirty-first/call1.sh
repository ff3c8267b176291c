export TRITON_DEFAULT_FP_FUSION=1
python3 bench/results/h200-2026-12-04-thirty-first/plan_ab.py A H V B AH AHV AHB AHBV HB 2>&1 | tee $OUT/call1-plan-ab.txt | tail -30
