#!/bin/bash
export TRITON_DEFAULT_FP_FUSION=1
python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fused_moe_gpu.py > $OUT/tests-moe.txt 2>&1; echo "moe tests rc $?"; tail -2 $OUT/tests-moe.txt
python3 bench/fused_moe.py --tokens 3,8,16,32,64 --formats fp8 > $OUT/moe.txt 2>&1; tail -7 $OUT/moe.txt | cut -c1-250
S="--formats fp8 --modes graph --contexts 8100 --batches 8 16 32 --depths 8 76 --pool-gib 40 --pdl on"
(cd .probe/old && python3 bench/step.py $S) > $OUT/step-old-1.txt 2>&1
python3 bench/step.py $S > $OUT/step-new-1.txt 2>&1
(cd .probe/old && python3 bench/step.py $S) > $OUT/step-old-2.txt 2>&1
python3 bench/step.py $S > $OUT/step-new-2.txt 2>&1
python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decode_graphs_gpu.py > $OUT/tests-graphs.txt 2>&1; echo "graph tests rc $?"; tail -2 $OUT/tests-graphs.txt
for f in old-1 new-1 old-2 new-2; do echo "== $f"; grep "^fp8  graph" $OUT/step-$f.txt | cut -c1-150; done
