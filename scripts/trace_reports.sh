#!/usr/bin/env bash
# A profiling trace's reports as JSON beside it: `bash scripts/trace_reports.sh TRACE.npz PREFIX` writes
# PREFIX_page_stats.json (the paged workers' page stats: meaningful in a MK_PG_PAGE_STATS=1 build),
# PREFIX_bandwidth.json (each layer's HBM rate), PREFIX_sm_states.json and PREFIX_attn_stats.json (attention's
# chunk sums: meaningful under MK_ATTN_STATS=1). PAGE_STATS=print also prints the page stats' table, PAGE_STATS=skip
# leaves them out (default json: written, not printed). Errors are not fatal; a report may still be written for a
# build it does not apply to (attn_stats.py then says chunk_sums: false, page_stats.py's sums are meaningless without
# MK_PG_PAGE_STATS=1): the caller knows its build.
set -u
npz=$1; prefix=$2
case "${PAGE_STATS:-json}" in
  skip) ;;
  print) python3 benchmarks/page_stats.py "$npz" --json "${prefix}_page_stats.json" 2>&1 | tail -12;;
  *) python3 benchmarks/page_stats.py "$npz" --json "${prefix}_page_stats.json" > /dev/null 2>&1;;
esac
python3 benchmarks/layer_bandwidth.py "$npz" --json "${prefix}_bandwidth.json" > /dev/null 2>&1
python3 benchmarks/sm_states.py "$npz" --json "${prefix}_sm_states.json" > /dev/null 2>&1
python3 benchmarks/attn_stats.py "$npz" --json "${prefix}_attn_stats.json" > /dev/null 2>&1
true
