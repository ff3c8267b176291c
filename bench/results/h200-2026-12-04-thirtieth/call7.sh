export TRITON_DEFAULT_FP_FUSION=1
mkdir -p $OUT/policies
end=$((SECONDS + 320))
for p in hybrid offload hybrid offload hybrid; do
  left=$((end - SECONDS)); [ $left -lt 30 ] && break
  timeout $left python3 bench/policies.py --scale 0.0625 --turns 13 --trace model --policies $p > $OUT/policies/pressure-$p-$SECONDS.txt 2>&1
  tail -1 $OUT/policies/pressure-$p-*.txt | tail -1
done
timeout 230 python3 bench/policies.py --scale 0.0625 --turns 13 --trace model --policies --no-pressure-check --no-pressure-repeats 4 > $OUT/policies/no-pressure.txt 2>&1; echo rc $?
tail -12 $OUT/policies/no-pressure.txt
for f in $OUT/policies/pressure-*.txt; do echo "$f: $(tail -1 $f)"; done
