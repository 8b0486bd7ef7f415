// Microbenchmark: the paged MoE worker's per-page math at one input row, alone on an SM (no HBM traffic).
// MK_PG_PAGE_STATS traces (SPEED_NOTES, session 21) put a b1 page's math at ~1.5 us (gate/up: 4 rows of 2048), ~2.8
// (down: 10 rows of 768) and ~2.1 (O: 2 rows of 4096) per computing warp, while its warps wait ~5 us per page for
// the copy: with 12 pages per SM, a page in math is a page not in flight. This times pg_rows (mk_moe_pages.cuh's
// CUDA-core loop, copied here) and alternatives on `warps` warps at once, each on its own 16 KB page in shared
// memory, and prints ns per page per warp and the SM's GB/s of weights.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a benchmarks/page_math.cu -o /tmp/page_math
//   /tmp/page_math
#include <cstdio>
#include <cstdlib>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

constexpr int PAGE = 16384;
constexpr int MAXW = 12;
extern __shared__ __align__(128) unsigned char smem[];

__device__ __forceinline__ void unpack8(const uint4& u, float* f) {
    f[0] = __uint_as_float(u.x << 16); f[1] = __uint_as_float(u.x & 0xffff0000u);
    f[2] = __uint_as_float(u.y << 16); f[3] = __uint_as_float(u.y & 0xffff0000u);
    f[4] = __uint_as_float(u.z << 16); f[5] = __uint_as_float(u.z & 0xffff0000u);
    f[6] = __uint_as_float(u.w << 16); f[7] = __uint_as_float(u.w & 0xffff0000u);
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// v0: mk_moe_pages.cuh's pg_rows
template <int RMAX>
__device__ __forceinline__ void rows_v0(const __nv_bfloat16* W, const __nv_bfloat16* x, int nr, int K, float* out) {
    const int lane = threadIdx.x & 31, KC = K >> 3;
    float acc[RMAX];
#pragma unroll
    for (int r = 0; r < RMAX; r++) acc[r] = 0.f;
    const uint4* wv = reinterpret_cast<const uint4*>(W);
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    for (int c = lane; c < KC; c += 32) {
        float xf[8];
        unpack8(xv[c], xf);
#pragma unroll
        for (int r = 0; r < RMAX; r++) {
            if (r < nr) {
                float wf[8];
                unpack8(wv[(size_t)r * KC + c], wf);
#pragma unroll
                for (int e = 0; e < 8; e++) acc[r] = fmaf(wf[e], xf[e], acc[r]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RMAX; r++) {
        if (r < nr) {
            const float v = warp_sum(acc[r]);
            if (lane == 0) out[r] = v;
        }
    }
}

// v1: the whole page's rows as one flat list of (row, chunk) work: lane i takes chunks i, i + 32, ... of the
// page's nr * KC chunks (no per-row predication, every lane busy whatever nr), two loads in flight per step;
// per-row sums by a shuffle reduction over the lanes that hold that row (rows span whole multiples of 32 chunks
// when KC % 32 == 0, so a lane's chunks all belong to rows r = (i + 32 k) / KC).
template <int RMAX>
__device__ __forceinline__ void rows_v1(const __nv_bfloat16* W, const __nv_bfloat16* x, int nr, int K, float* out) {
    const int lane = threadIdx.x & 31, KC = K >> 3;
    float acc[RMAX];
#pragma unroll
    for (int r = 0; r < RMAX; r++) acc[r] = 0.f;
    const uint4* wv = reinterpret_cast<const uint4*>(W);
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    // rows in the outer loop, chunks inner, two chunks per iteration with independent accumulators
#pragma unroll
    for (int r = 0; r < RMAX; r++) {
        if (r < nr) {
            float a0 = 0.f, a1 = 0.f;
            int c = lane;
            for (; c + 32 < KC; c += 64) {
                const uint4 w0 = wv[(size_t)r * KC + c], w1 = wv[(size_t)r * KC + c + 32];
                const uint4 x0 = xv[c], x1 = xv[c + 32];
                float wf[8], xf[8], wg[8], xg[8];
                unpack8(w0, wf); unpack8(x0, xf); unpack8(w1, wg); unpack8(x1, xg);
#pragma unroll
                for (int e = 0; e < 8; e++) { a0 = fmaf(wf[e], xf[e], a0); a1 = fmaf(wg[e], xg[e], a1); }
            }
            if (c < KC) {
                float wf[8], xf[8];
                unpack8(wv[(size_t)r * KC + c], wf); unpack8(xv[c], xf);
#pragma unroll
                for (int e = 0; e < 8; e++) a0 = fmaf(wf[e], xf[e], a0);
            }
            acc[r] = a0 + a1;
        }
    }
    // one transpose-style reduction: after it lane r holds row r's sum (RMAX <= 32)
#pragma unroll
    for (int r = 0; r < RMAX; r++) {
        if (r < nr) {
            const float v = warp_sum(acc[r]);
            if (lane == 0) out[r] = v;
        }
    }
}

// v2: tensor cores (mma.m16n8k16, bf16 in, fp32 accumulate): the input row as row 0 of A (rows 1-15 zero), 8
// weight rows as N; K in steps of 16 with 4 independent accumulators.
__device__ __forceinline__ void mma16816(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                         unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void rows_v2(const __nv_bfloat16* W, const __nv_bfloat16* x, int nr, int K, float* out) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    // lane (g, t): A row g (only g == 0 is the input), k offsets 8t..8t+7 within a 32-wide step (permuted k order,
    // the same for A and B); B column g = weight row r0 + g
    const __nv_bfloat16* xa = x + 8 * t;
    for (int r0 = 0; r0 < nr; r0 += 8) {
        const __nv_bfloat16* wr = W + (size_t)min(r0 + g, nr - 1) * K + 8 * t;
        float c[4][4] = {};
        const int steps = K >> 5;
#pragma unroll 4
        for (int s = 0; s < steps; s++) {
            const uint4 X = g == 0 ? *reinterpret_cast<const uint4*>(xa + s * 32) : make_uint4(0, 0, 0, 0);
            const uint4 B = *reinterpret_cast<const uint4*>(wr + s * 32);
            mma16816(c[s & 3], X.x, 0u, X.y, 0u, B.x, B.y);
            mma16816(c[s & 3], X.z, 0u, X.w, 0u, B.z, B.w);
        }
        // c[.][0..1]: A row g, weight rows r0 + 2t, + 1 (only g == 0 holds the input row)
        if (g == 0) {
#pragma unroll
            for (int q = 0; q < 2; q++) {
                const int r = r0 + 2 * t + q;
                if (r < nr) out[r] = c[0][q] + c[1][q] + c[2][q] + c[3][q];
            }
        }
    }
}


// seg: tensor cores with the page's weight rows as the MMA's A operand and K cut into S segments: A row i is
// (weight row i / S, segment i % S), B column j is segment j of x (columns S..7 zero), and C[i][i % S] holds the
// segment's dot product; a row's S segment sums meet through a few shuffles. nr * S <= 16 rows of A (S = 16 / nr
// rounded down to a power of two, at most 8), K a multiple of 32 S. Each A row walks its segment's 32-element steps
// from step s (rotated, wrapping) so the 8 lanes of a quarter-warp read different banks (B column j likewise).
template <int S, int UNR = 2>
__device__ __forceinline__ void rows_seg(const __nv_bfloat16* W, const __nv_bfloat16* x, int nr, int K, float* out) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int KS = K / S, NSTEP = KS >> 5, s = g % S;
    const __nv_bfloat16* a_lo = W + (size_t)min(g / S, nr - 1) * K + s * KS + 8 * t;         // A row g
    const __nv_bfloat16* a_hi = W + (size_t)min((g + 8) / S, nr - 1) * K + s * KS + 8 * t;   // A row g + 8
    const bool has_b = g < S;
    const __nv_bfloat16* b = x + (has_b ? g : 0) * KS + 8 * t;                               // B column g
    float c[UNR][4];
#pragma unroll
    for (int i = 0; i < UNR; i++) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.f;
    int u = s;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    int k = 0;
    for (; k + UNR <= NSTEP; k += UNR) {        // UNR steps' loads first, then their MMAs
        uint4 X[UNR], Y[UNR], B[UNR];
#pragma unroll
        for (int i = 0; i < UNR; i++) {
            const int off = u * 32;
            X[i] = *reinterpret_cast<const uint4*>(a_lo + off);
            Y[i] = *reinterpret_cast<const uint4*>(a_hi + off);
            B[i] = has_b ? *reinterpret_cast<const uint4*>(b + off) : zero;
            u = u + 1 == NSTEP ? 0 : u + 1;
        }
#pragma unroll
        for (int i = 0; i < UNR; i++) {
            mma16816(c[i], X[i].x, Y[i].x, X[i].y, Y[i].y, B[i].x, B[i].y);
            mma16816(c[i], X[i].z, Y[i].z, X[i].w, Y[i].w, B[i].z, B[i].w);
        }
    }
    for (; k < NSTEP; k++) {
        const int off = u * 32;
        const uint4 X = *reinterpret_cast<const uint4*>(a_lo + off);
        const uint4 Y = *reinterpret_cast<const uint4*>(a_hi + off);
        const uint4 B = has_b ? *reinterpret_cast<const uint4*>(b + off) : zero;
        mma16816(c[0], X.x, Y.x, X.y, Y.y, B.x, B.y);
        mma16816(c[0], X.z, Y.z, X.w, Y.w, B.z, B.w);
        u = u + 1 == NSTEP ? 0 : u + 1;
    }
#pragma unroll
    for (int i = 1; i < UNR; i++)
#pragma unroll
        for (int q = 0; q < 4; q++) c[0][q] += c[i][q];
    // lane (g, t) holds C[g][2t..2t+1] and C[g+8][2t..2t+1]; A rows g and g + 8 want column s
    const bool mine = (s >> 1) == t;
    float vlo = mine ? c[0][s & 1] : 0.f;
    float vhi = mine ? c[0][2 + (s & 1)] : 0.f;
    // sum over the lanes of one weight row: lane bits 0-1 (t) and the low log2(S) bits of g (lane bits 2..)
#pragma unroll
    for (int m = 1; m < 4 * S; m <<= 1) {
        vlo += __shfl_xor_sync(0xffffffffu, vlo, m);
        vhi += __shfl_xor_sync(0xffffffffu, vhi, m);
    }
    if (t == 0 && s == 0) {
        const int r_lo = g / S, r_hi = (g + 8) / S;
        if (r_lo < nr) out[r_lo] = vlo;
        if (r_hi < nr) out[r_hi] = vhi;
    }
}

// Every computing warp w < warps: `reps` times, its page at smem + w * PAGE (nr rows of K) times x (after the
// pages); per-warp clock cycles into cyc[blockIdx.x * MAXW + w].
template <int V, int RMAX>
__global__ void __launch_bounds__(512, 1) bench(int warps, int nr, int K, int reps, long long* cyc, float* sink) {
    const int warp = threadIdx.x >> 5;
    for (int i = threadIdx.x; i < (MAXW * PAGE + 8192) / 4; i += blockDim.x)
        reinterpret_cast<unsigned*>(smem)[i] = 0x3f803f80u ^ (i * 2654435761u & 0x00ff00ffu);
    __syncthreads();
    if (warp >= warps) return;
    const __nv_bfloat16* Wp = reinterpret_cast<const __nv_bfloat16*>(smem + (size_t)warp * PAGE);
    const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(smem + (size_t)MAXW * PAGE);
    __shared__ float outs[MAXW][32];
    float s = 0.f;
    const long long t0 = clock64();
    for (int i = 0; i < reps; i++) {
        if (V == 0) rows_v0<RMAX>(Wp, x, nr, K, outs[warp]);
        else if (V == 1) rows_v1<RMAX>(Wp, x, nr, K, outs[warp]);
        else if (V == 2) rows_v2(Wp, x, nr, K, outs[warp]);
        else if (V == 3) rows_seg<RMAX, 2>(Wp, x, nr, K, outs[warp]);
        else if (V == 4) rows_seg<RMAX, 4>(Wp, x, nr, K, outs[warp]);
        __syncwarp();
        s += outs[warp][i % nr];
    }
    const long long t1 = clock64();
    if ((threadIdx.x & 31) == 0) { cyc[blockIdx.x * MAXW + warp] = t1 - t0; sink[blockIdx.x * MAXW + warp] = s; }
}

// The seg product against pg_rows on one page of pseudo-random weights: the largest |difference| relative to the
// largest |output|, into err[0].
template <int S, int RMAX>
__global__ void check(int nr, int K, float* err) {
    for (int i = threadIdx.x; i < (PAGE + 8192) / 2; i += blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u;
        h ^= h >> 13;
        reinterpret_cast<unsigned short*>(smem)[i] = (unsigned short)(0x3c00u + (h & 0x3ffu)) ^ ((h >> 10) & 1u ? 0x8000u : 0u);
    }
    __syncthreads();
    if (threadIdx.x >= 32) return;
    __shared__ float a[32], b[32];
    const __nv_bfloat16* Wp = reinterpret_cast<const __nv_bfloat16*>(smem);
    const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(smem + PAGE);
    rows_v0<RMAX>(Wp, x, nr, K, a);
    rows_seg<S, 4>(Wp, x, nr, K, b);
    __syncwarp();
    if (threadIdx.x == 0) {
        float mx = 0.f, d = 0.f;
        for (int r = 0; r < nr; r++) { mx = fmaxf(mx, fabsf(a[r])); d = fmaxf(d, fabsf(a[r] - b[r])); }
        err[0] = d / fmaxf(mx, 1e-30f);
    }
}

template <int V, int RMAX>
void run(const char* name, int warps, int nr, int K, int sms, long long* cyc, float* sink, double ghz) {
    const int reps = 200, smem_bytes = MAXW * PAGE + 8192;
    CK(cudaFuncSetAttribute(bench<V, RMAX>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
    bench<V, RMAX><<<sms, 512, smem_bytes>>>(warps, nr, K, reps, cyc, sink);
    CK(cudaDeviceSynchronize());
    long long h[MAXW * 132];
    CK(cudaMemcpy(h, cyc, sizeof(long long) * MAXW * sms, cudaMemcpyDeviceToHost));
    double mx = 0;
    for (int b = 0; b < sms; b++)
        for (int w = 0; w < warps; w++) mx = h[b * MAXW + w] > mx ? h[b * MAXW + w] : mx;
    const double ns_page = mx / reps / ghz;
    const double gbs = (double)warps * nr * K * 2 / ns_page;      // bytes per ns = GB/s, per SM
    printf("%-6s rows %2d x K %4d, %2d warps: %7.0f ns per page per warp, %6.1f GB/s per SM\n", name, nr, K, warps,
           ns_page, gbs);
}

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    int khz = 0;
    CK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
    const double ghz = khz / 1e6;
    const int sms = prop.multiProcessorCount;
    long long* cyc;
    float* sink;
    CK(cudaMalloc(&cyc, sizeof(long long) * MAXW * sms));
    CK(cudaMalloc(&sink, sizeof(float) * MAXW * sms));
    printf("# %s, clock %.2f GHz (cycles -> ns at that clock), every SM runs the same\n", prop.name, ghz);
    float* err;
    CK(cudaMalloc(&err, 4));
    auto chk = [&](auto kern, int nr, int K) {
        CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, PAGE + 8192));
        kern<<<1, 64, PAGE + 8192>>>(nr, K, err);
        CK(cudaDeviceSynchronize());
        float e = 0.f;
        CK(cudaMemcpy(&e, err, 4, cudaMemcpyDeviceToHost));
        printf("check seg rows %2d x K %4d: max |seg - pg_rows| / max |out| = %.2e\n", nr, K, e);
    };
    chk(check<4, 4>, 4, 2048);
    chk(check<4, 4>, 3, 2048);
    chk(check<8, 2>, 2, 4096);
    chk(check<8, 2>, 1, 4096);
    chk(check<1, 16>, 10, 768);
    chk(check<1, 16>, 16, 768);
    const int ws[] = {1, 4, 12};
    for (int w : ws) {
        run<0, 4>("v0", w, 4, 2048, sms, cyc, sink, ghz);
        run<1, 4>("v1", w, 4, 2048, sms, cyc, sink, ghz);
        run<2, 4>("tc", w, 4, 2048, sms, cyc, sink, ghz);
        run<3, 4>("seg", w, 4, 2048, sms, cyc, sink, ghz);
        run<4, 4>("seg4", w, 4, 2048, sms, cyc, sink, ghz);
        run<0, 16>("v0", w, 10, 768, sms, cyc, sink, ghz);
        run<1, 16>("v1", w, 10, 768, sms, cyc, sink, ghz);
        run<2, 16>("tc", w, 10, 768, sms, cyc, sink, ghz);
        run<3, 1>("seg", w, 10, 768, sms, cyc, sink, ghz);
        run<4, 1>("seg4", w, 10, 768, sms, cyc, sink, ghz);
        run<0, 2>("v0", w, 2, 4096, sms, cyc, sink, ghz);
        run<1, 2>("v1", w, 2, 4096, sms, cyc, sink, ghz);
        run<2, 2>("tc", w, 2, 4096, sms, cyc, sink, ghz);
        run<3, 8>("seg", w, 2, 4096, sms, cyc, sink, ghz);
        run<4, 8>("seg4", w, 2, 4096, sms, cyc, sink, ghz);
    }
    return 0;
}
