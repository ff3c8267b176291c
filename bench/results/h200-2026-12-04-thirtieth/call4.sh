export TRITON_DEFAULT_FP_FUSION=1
python3 .probe/clk.py 2>&1 | tail -40
python3 -m pytest -q -p no:cacheprovider tests/gpu/test_resolve_gpu.py tests/gpu/test_decode_graphs_gpu.py tests/gpu/test_rank_residency_gpu.py 2>&1 | grep -E "passed|failed|error" | tail -3
