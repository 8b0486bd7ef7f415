#!/usr/bin/env bash
# The device tool brings back at most 8 files from $OUT: with more, pack them all into $OUT/bundle.tgz (unpack with
# `tar xzf bundle.tgz`) so none is left behind. Called at the end of the multi-stage device scripts.
set -u
OUT=${1:-${OUT:-gpu-out}}
n=$(find "$OUT" -type f | wc -l)
if [ "$n" -gt 8 ]; then
  (cd "$OUT" && tar czf /tmp/bundle.tgz --exclude=bundle.tgz . && find . -type f -delete && mv /tmp/bundle.tgz bundle.tgz)
  echo "packed $n files into $OUT/bundle.tgz"
fi
