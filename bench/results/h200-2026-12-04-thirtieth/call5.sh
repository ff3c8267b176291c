export TRITON_DEFAULT_FP_FUSION=1
python3 -m pytest -q -p no:cacheprovider tests/gpu/test_resolve_gpu.py tests/gpu/test_decode_graphs_gpu.py tests/gpu/test_rank_residency_gpu.py tests/gpu/test_pdl_gpu.py > $OUT/tests.txt 2>&1
tail -2 $OUT/tests.txt
python3 .probe/plan_ab.py > $OUT/plan-ab.txt 2>&1; tail -45 $OUT/plan-ab.txt
timeout 240 python3 bench/kernels_residency.py > $OUT/kernels-residency.txt 2>&1; echo rc $?
grep -A32 "in CUDA graph" $OUT/kernels-residency.txt | head -32
