set -x
export TRITON_DEFAULT_FP_FUSION=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
python3 -m pytest -q -p no:cacheprovider tests/gpu/test_resolve_gpu.py 2>&1 | tail -4 > $OUT/tests-resolve.txt
cat $OUT/tests-resolve.txt
python3 .probe/plan_ab.py > $OUT/plan-ab.txt 2>&1; tail -35 $OUT/plan-ab.txt
timeout 240 python3 bench/kernels_residency.py > $OUT/kernels-residency.txt 2>&1; echo rc $?
python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decode_graphs_gpu.py tests/gpu/test_rank_residency_gpu.py 2>&1 | tail -3 > $OUT/tests-graphs.txt
cat $OUT/tests-graphs.txt
grep -A40 "in CUDA graph" $OUT/kernels-residency.txt | head -45
