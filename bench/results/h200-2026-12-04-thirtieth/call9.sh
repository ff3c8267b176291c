export TRITON_DEFAULT_FP_FUSION=1
mkdir -p $OUT/np
timeout 150 python3 bench/policies.py --scale 0.0625 --turns 13 --trace model --policies --no-pressure-check --no-pressure-repeats 3 > $OUT/np/new.txt 2>&1; echo rc $?
(cd .probe/old && timeout 150 python3 bench/policies.py --scale 0.0625 --turns 13 --trace model --policies --no-pressure-check --no-pressure-repeats 3 > $OUT/np/old.txt 2>&1; echo rc $?)
for f in new old; do echo "== $f"; grep -A4 "^no pressure" $OUT/np/$f.txt; done
