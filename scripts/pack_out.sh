#!/usr/bin/env bash
# The device tool brings back at most 8 files from $OUT: with more, pack them all into $OUT/bundle.tgz (unpack with
# `tar xzf bundle.tgz`) so none is left behind. Called at the end of the multi-stage device scripts.
set -u
OUT=${1:-${OUT:-gpu-out}}
n=$(find "$OUT" -type f | wc -l)
if [ "$n" -gt 8 ]; then
  # (an earlier bundle goes inside the new one, as bundle_prev.tgz, instead of being deleted with the rest)
  (cd "$OUT" && { [ -f bundle.tgz ] && mv bundle.tgz bundle_prev.tgz; true; } && tar czf /tmp/bundle.tgz . &&
   find . -type f -delete && mv /tmp/bundle.tgz bundle.tgz)
  echo "packed $n files into $OUT/bundle.tgz"
fi
