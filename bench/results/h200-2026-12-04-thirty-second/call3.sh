export TRITON_DEFAULT_FP_FUSION=1; mkdir -p $OUT/np
timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu/test_rank_residency_gpu.py tests/gpu/test_decode_graphs_gpu.py tests/gpu/test_page_loads_gpu.py > $OUT/gpu-tests.txt 2>&1; echo tests rc $?
timeout 100 python3 .probe/mirror_host.py > $OUT/mirror-host.txt 2>&1; echo host rc $?
timeout 310 python3 bench/policies.py --scale 0.0625 --turns 13 --trace model --policies --no-pressure-check --no-pressure-repeats 8 > $OUT/np/no-pressure-220.txt 2>&1; echo np rc $?
tail -3 $OUT/gpu-tests.txt; grep mirror_step $OUT/mirror-host.txt; tail -7 $OUT/np/no-pressure-220.txt
