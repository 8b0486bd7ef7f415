// Host side of the swizzled weight tiles (csrc/mk_gemv_swz.cuh): the 2D tensor map of a row-major bf16 matrix of
// `rows` x K at `base`, boxes of 64 columns x box_rows rows, 128-byte swizzle. Encoded through the driver's entry
// point (no link against libcuda). Used by the megakernel's mk_encode_swizzled and benchmarks/gemv_stream.cu.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include <cstring>

typedef CUresult (*MkEncodeTiled)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                  const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                  CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's encoder, looked up once; nullptr if the driver has none.
static inline MkEncodeTiled mk_tmap_encoder() {
    static MkEncodeTiled fn = nullptr;
    if (!fn) {
        cudaDriverEntryPointQueryResult q;
        void* f = nullptr;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
            q != cudaDriverEntryPointSuccess || !f)
            return nullptr;
        fn = reinterpret_cast<MkEncodeTiled>(f);
    }
    return fn;
}

// Into *map (zeroed first). 0 on success, else -1 (no entry point) or 1000 + the CUresult.
static inline int mk_tmap_encode_swizzled(CUtensorMap* map, const void* base, unsigned long long rows, int K,
                                          int box_rows) {
    const MkEncodeTiled fn = mk_tmap_encoder();
    if (!fn) return -1;
    const cuuint64_t dims[2] = {(cuuint64_t)K, rows};
    const cuuint64_t strides[1] = {(cuuint64_t)K * 2};
    const cuuint32_t box[2] = {64, (cuuint32_t)box_rows};
    const cuuint32_t estr[2] = {1, 1};
    memset(map, 0, sizeof(*map));
    const CUresult r = fn(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box, estr,
                          CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? 0 : 1000 + (int)r;
}

// The same matrix seen as 3D, (64 columns, rows, K / 64 column blocks) with strides (K * 2, 128) bytes, and one box
// of (64, box_rows, box_blocks column blocks; 0: K / 64): a single tensor copy then brings box_rows rows (whole, by
// default), and its shared-memory image [column block][row][64 columns] is the 2D boxes' layout (column block kb at
// kb * box_rows * 128). Attention's KV maps (MK_ATTN_BULK=2) view a pool's token rows of every kv head this way,
// with box_blocks = head_dim / 64: one copy brings box_rows tokens of one kv head. 0 on success, else as above.
static inline int mk_tmap_encode_swizzled_3d(CUtensorMap* map, const void* base, unsigned long long rows, int K,
                                             int box_rows, int box_blocks = 0) {
    const MkEncodeTiled fn = mk_tmap_encoder();
    if (!fn) return -1;
    const cuuint64_t dims[3] = {64, rows, (cuuint64_t)(K / 64)};
    const cuuint64_t strides[2] = {(cuuint64_t)K * 2, 128};
    const cuuint32_t box[3] = {64, (cuuint32_t)box_rows, (cuuint32_t)(box_blocks ? box_blocks : K / 64)};
    const cuuint32_t estr[3] = {1, 1, 1};
    memset(map, 0, sizeof(*map));
    const CUresult r = fn(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(base), dims, strides, box, estr,
                          CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? 0 : 1000 + (int)r;
}

