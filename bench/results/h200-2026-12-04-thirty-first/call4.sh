export TRITON_DEFAULT_FP_FUSION=1
timeout 400 python3 .probe/np_ablate.py 4 > $OUT/np-ablate.txt 2>&1; echo rc $?
grep -v "^{" $OUT/np-ablate.txt | tail -24
