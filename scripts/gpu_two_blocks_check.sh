#!/usr/bin/env bash
# One device call (~7 min; each stage's timeout keeps the whole under 600 s) for the two-blocks-per-SM experiment
# (MEGAKERNEL_BLOCKS_PER_SM=2: 256-thread blocks, two per SM, 113 KB of shared memory each, 64-key attention chunks,
# at most 8 rows per launch; benchmarks/SPEED_NOTES.md, eighth session, next step 1):
#   1. its megakernel GPU tests (tests/kernel: tiny parity at batch 1/3/8/16 (16 as two launches), the per-layer
#      North acceptance, the attention ring, the watchdog, the profile build);
#   2. the step at $POINTS in the default build (control) and in the experiment, each in its own process
#      ($TWO_VARIANTS: plan knobs for the experiment, e.g. tile_kb=0 for power-of-two tiles);
#   3. its SM timeline at batch 1, 8K (summary only; "SM" figures there are per block).
# Everything comes back in $OUT/bundle.tgz.
#   run(command="MEGAKERNEL_COMMIT=<SHA> bash scripts/gpu_two_blocks_check.sh", timeout_s=600)
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MEGAKERNEL_CACHE_DIR=/tmp/mkcache
POINTS=${POINTS:-1x8192,2x8192,4x8192,8x8192}
t0=$(date +%s)
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
  echo "commit ${MEGAKERNEL_COMMIT:-unknown}"; } | tee "$OUT/env.txt"
echo "=== tests, two blocks per SM"
MEGAKERNEL_BLOCKS_PER_SM=2 timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -x -m gpu -p no:cacheprovider \
  tests/kernel 2>&1 | tee "$OUT/tests_two_blocks.log" | tail -3
echo "=== variants, default build, at $(($(date +%s) - t0)) s"
timeout ${VARIANTS_TIMEOUT:-120} python3 benchmarks/megakernel_variants.py --points "$POINTS" \
  --variants default --steps 30 --json "$OUT/variants_one_block.json" 2>&1 | grep -E "^b|rror"
echo "=== variants, two blocks per SM, at $(($(date +%s) - t0)) s"
MEGAKERNEL_BLOCKS_PER_SM=2 timeout ${VARIANTS_TIMEOUT:-120} python3 benchmarks/megakernel_variants.py \
  --points "$POINTS" --variants "default ${TWO_VARIANTS:-tile_kb=0}" --steps 30 \
  --json "$OUT/variants_two_blocks.json" 2>&1 | grep -E "^b|rror"
echo "=== trace b1, two blocks per SM, at $(($(date +%s) - t0)) s"
MEGAKERNEL_BLOCKS_PER_SM=2 timeout ${TRACE_TIMEOUT:-120} python3 -m megakernel bench --random-north \
  --backend megakernel --batch-size 1 --context 8192 --steps 20 --trace "$OUT/tl_b1_two_blocks.npz" 2>&1 \
  | grep -E "critical|SM time|a layer|normal build|^megakernel|rror"
rm -f "$OUT/tl_b1_two_blocks.npz"
echo "=== done at $(($(date +%s) - t0)) s"
bash scripts/pack_out.sh "$OUT"
