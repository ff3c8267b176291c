export TRITON_DEFAULT_FP_FUSION=1
timeout 420 python3 .probe/np_parts.py 6 > $OUT/np-parts.txt 2>&1; echo rc $?
grep -v "^{" $OUT/np-parts.txt | tail -30
