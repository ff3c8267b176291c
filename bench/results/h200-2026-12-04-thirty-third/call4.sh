#!/bin/bash
# B = 1 with PDL off: each kernel's own time a layer (the map of a one-token layer)
export TRITON_DEFAULT_FP_FUSION=1
mkdir -p $OUT/prof-off
python3 bench/step.py --formats fp8 --modes graph --contexts 8100 --batches 1 --depths 4 8 --pool-gib 40 --pdl off --profile $OUT/prof-off --profile-batches 1 > $OUT/step-off.txt 2>&1
echo rc $?
tail -4 $OUT/step-off.txt | cut -c1-170
ls $OUT/prof-off
head -40 $OUT/prof-off/profile-8l-8100-B1.txt | cut -c1-110
