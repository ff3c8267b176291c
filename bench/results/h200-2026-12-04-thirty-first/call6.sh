export TRITON_DEFAULT_FP_FUSION=1
python3 -m pytest -q -p no:cacheprovider tests/gpu/test_resolve_gpu.py tests/gpu/test_decode_graphs_gpu.py tests/gpu/test_rank_residency_gpu.py tests/gpu/test_pdl_gpu.py > $OUT/tests.txt 2>&1
grep -E "passed|failed" $OUT/tests.txt | tail -2
cp .probe/old/kernels/resolve.py .probe/vold_resolve.py
python3 bench/results/h200-2026-12-04-thirty-first/plan_ab.py old > $OUT/call6-plan-ab.txt 2>&1; echo rc $?
tail -17 $OUT/call6-plan-ab.txt
