#!/bin/bash
export TRITON_DEFAULT_FP_FUSION=1
S="--formats fp8 --modes graph --contexts 8100 --batches 1 3 4 --depths 8 76 --pool-gib 40 --pdl on"
(cd .probe/old && python3 bench/step.py $S) > $OUT/step-old-1.txt 2>&1
python3 bench/step.py $S > $OUT/step-new-1.txt 2>&1
(cd .probe/old && python3 bench/step.py $S) > $OUT/step-old-2.txt 2>&1
python3 bench/step.py $S > $OUT/step-new-2.txt 2>&1
for f in old-1 new-1 old-2 new-2; do echo "== $f"; grep "^fp8  graph" $OUT/step-$f.txt | cut -c1-150; done
