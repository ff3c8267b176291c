export TRITON_DEFAULT_FP_FUSION=1
timeout 420 python3 .probe/np_prof.py > $OUT/np-prof.txt 2>&1; echo rc $?
grep -v "^{" $OUT/np-prof.txt | tail -85
