#!/bin/bash
# the top-K writes the positions past a row's limit as 0 (no masked fill at a full layer): GPU tests, step
export TRITON_DEFAULT_FP_FUSION=1
python3 -m pytest -q -p no:cacheprovider tests/gpu/test_topk_gpu.py -k "limits or equals_the_stable or cuda_graph or one_program" > $OUT/tests-topk.txt 2>&1; echo "topk tests rc $?"; tail -1 $OUT/tests-topk.txt
S="--formats fp8 --modes graph --contexts 8100 --batches 1 8 --depths 8 76 --pool-gib 40 --pdl on"
python3 bench/step.py $S > $OUT/step-new.txt 2>&1
(cd .probe/old && python3 bench/step.py $S) > $OUT/step-old.txt 2>&1
for f in old new; do echo "== $f"; grep "^fp8  graph" $OUT/step-$f.txt | cut -c1-150; done
python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decode_graphs_gpu.py tests/gpu/test_indexer_gpu.py > $OUT/tests-graphs.txt 2>&1; echo "graph+indexer tests rc $?"; tail -1 $OUT/tests-graphs.txt
