#!/usr/bin/env bash
# On the device, first in a call that carries .mkcache (scripts/prebuild_kernels.py built it here): copy the
# prebuilt kernel builds into $MEGAKERNEL_CACHE_DIR (default /tmp/mkcache) if one of them loads on this machine
# (other system libraries may refuse a library built elsewhere); else leave the cache alone and the builds compile
# here as usual. Prints which happened. Run it with bash (sourced, its `exit` would end the caller's shell).
set -u
cache=${MEGAKERNEL_CACHE_DIR:-/tmp/mkcache}
[ -d .mkcache ] || { echo "carried cache: none"; exit 0; }
lib=$(ls .mkcache/*/libmegakernel.so 2>/dev/null | head -1)
[ -n "$lib" ] || { echo "carried cache: empty"; exit 0; }
if python3 - "$lib" <<'EOF'
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
lib.mk_num_params.restype = ctypes.c_int
print("carried cache: a build loads here,", lib.mk_num_params(), "params")
EOF
then
  mkdir -p "$cache" && cp -r .mkcache/. "$cache/"
  n=$(ls -d .mkcache/*/ | wc -l)
  echo "carried cache: $n builds copied into $cache; nvcc here: $(nvcc --version | tail -1)"
else
  echo "carried cache: a prebuilt library does not load here; compiling on this machine"
fi
