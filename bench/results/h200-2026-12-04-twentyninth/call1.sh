#!/bin/bash
# baseline profile at B = 1 and 8 (graph, PDL on), and PDL off for each kernel's own time
export TRITON_DEFAULT_FP_FUSION=1
mkdir -p $OUT/prof-on $OUT/prof-off
python3 bench/step.py --formats fp8 --modes graph --contexts 8100 --batches 1 8 --depths 8 76 --pool-gib 40 --pdl on --profile $OUT/prof-on --profile-batches 1 8 > $OUT/step-on.txt 2>&1
python3 bench/step.py --formats fp8 --modes graph --contexts 8100 --batches 8 --depths 4 8 --pool-gib 40 --pdl off --profile $OUT/prof-off --profile-batches 8 > $OUT/step-off.txt 2>&1
tail -6 $OUT/step-on.txt | cut -c1-160
for f in $OUT/prof-on/profile-8l-8100-B8.txt $OUT/prof-off/profile-8l-8100-B8.txt; do echo "== $f"; head -45 $f | cut -c1-110; done
