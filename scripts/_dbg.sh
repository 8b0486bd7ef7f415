export MEGAKERNEL_CACHE_DIR=/tmp/mkcache PYTHONPATH=$PWD
python3 -m megakernel.kernel.build > /dev/null
for a in "north_like 16" "softmax_shared_avg_untied_g4 3" "softmax_2dense_bias 3" "sigmoid_renorm_shared_sum_layernorm 16" "softmax_shared_avg_untied_g4 1"; do
  timeout 120 python3 benchmarks/mk_debug.py $a 2>&1 | grep -v "elems" 
done
