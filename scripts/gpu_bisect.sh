#!/usr/bin/env bash
# Times several commits' megakernels in one device call, each in its own process on the same machine (the device
# machines differ by up to ~10% in the megakernel's absolute ms/step, so only figures from one call compare). Prepare
# each older tree here first, small enough to travel (the working tree goes over at most 64 MiB):
#   for c in <sha> ...; do mkdir -p old_$c && git archive $c megakernel benchmarks/megakernel_variants.py \
#     | tar -x -C old_$c && rm -rf old_$c/megakernel/bundled; done
# then
#   run(command="MEGAKERNEL_COMMIT=<HEAD SHA> bash scripts/gpu_bisect.sh", timeout_s=600)
# and delete the old_* folders afterwards (they are not to be committed). Times "." (this checkout) first and last,
# every old_<sha> between; JSON per tree under $OUT with its commit.
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export MEGAKERNEL_CACHE_DIR=/tmp/mkcache PYTHONUNBUFFERED=1
POINTS=${POINTS:-1x8192,8x8192}
TREES=${TREES:-". $(ls -d old_* 2>/dev/null | tr '\n' ' ') ."}
head=${MEGAKERNEL_COMMIT:-unknown}
n=0
for d in $TREES; do
  n=$((n + 1))
  c=${d#old_}; [ "$d" = . ] && c=$head
  echo "=== $c ($d)"
  (cd "$d" && PYTHONPATH=$PWD MEGAKERNEL_COMMIT=$c timeout ${TREE_TIMEOUT:-100} python3 benchmarks/megakernel_variants.py \
     --points "$POINTS" --variants "${VARIANTS:-default}" --steps 40 --json "$OUT/bisect_${n}_$c.json" 2>&1 \
     | grep -E "^b|rror")
done
