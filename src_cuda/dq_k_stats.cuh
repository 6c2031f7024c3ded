// dq_k_stats.cuh -- the statistics pass (per super-group mean and norm of the centred values, flags).
// A part of dq_kernels.cu (one translation unit: the parts share its anonymous
// namespace and inline into each other); included there, in order, never alone.

// Statistics, two super-groups per warp.  A half-warp owns a
// super-group and lane h = lane & 15 holds entries h + 16 k, k = 0..15, so the
// header's halving tree is in-register for h >= 16 and four shuffle levels
// inside the half-warp; one shuffle serves both super-groups.  The warp reads
// its pair (512 consecutive entries) with 16-byte loads, two pairs ahead, and
// transposes through shared memory (rows padded by 16 floats: conflict-free).
// (The earlier kernel, a warp per super-group with 2-byte loads, ran at 505 us
// for 2^27 BF16 entries on an H200 against 136 us for this one, same bits.)
constexpr int kStatsRow = DQ_SUPER + 16;
template <int DT> struct StatsVec { static constexpr int N = DT ? 2 : 4; };   // uint4 per lane per pair

template <int DT>
__device__ __forceinline__ void stats_fetch(const DqSource& S, int64_t pair, int lane, bool vec,
                                            uint4 (&r)[StatsVec<DT>::N]) {
    constexpr int NV = StatsVec<DT>::N, PER = DT ? 8 : 4;   // vectors, entries per vector
#pragma unroll
    for (int j = 0; j < NV; j++) {
        const int64_t e0 = pair * (2 * DQ_SUPER) + (int64_t)(lane + 32 * j) * PER;
        if (vec && e0 + PER <= S.length) {
            r[j] = __ldg(reinterpret_cast<const uint4*>(static_cast<const char*>(S.x) + e0 * (DT ? 2 : 4)));
        } else {                                  // the tail, or an unaligned buffer
            uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
            for (int i = 0; i < PER; i++) {
                if (e0 + i < S.length) {
                    if (DT) w[i >> 1] |= (uint32_t)__ldg(static_cast<const uint16_t*>(S.x) + e0 + i) << (16 * (i & 1));
                    else w[i] = __float_as_uint(__ldg(static_cast<const float*>(S.x) + e0 + i));
                }
            }
            r[j] = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}
template <int DT>
__device__ __forceinline__ void stats_stage(float* sm, int lane, const uint4 (&r)[StatsVec<DT>::N]) {
    if (DT) {   // vector j: BF16 entries 8 lane .. 8 lane + 7 of super-group j
#pragma unroll
        for (int j = 0; j < 2; j++) {
            float* d = sm + j * kStatsRow + 8 * lane;
            const uint4 q = r[j];
            reinterpret_cast<float4*>(d)[0] = make_float4(__uint_as_float(q.x << 16), __uint_as_float(q.x & 0xFFFF0000u),
                                                          __uint_as_float(q.y << 16), __uint_as_float(q.y & 0xFFFF0000u));
            reinterpret_cast<float4*>(d)[1] = make_float4(__uint_as_float(q.z << 16), __uint_as_float(q.z & 0xFFFF0000u),
                                                          __uint_as_float(q.w << 16), __uint_as_float(q.w & 0xFFFF0000u));
        }
    } else {
#pragma unroll
        for (int j = 0; j < StatsVec<DT>::N; j++) {   // entries 4 (lane + 32 j) of the pair
            const int e = 4 * (lane + 32 * j);
            float* d = sm + (e >> 8) * kStatsRow + (e & 255);
            reinterpret_cast<float4*>(d)[0] = make_float4(__uint_as_float(r[j].x), __uint_as_float(r[j].y),
                                                          __uint_as_float(r[j].z), __uint_as_float(r[j].w));
        }
    }
}
// The header's tree over 16 lanes x 16 registers (lane h, register k = entry
// h + 16 k), from its first level on (b[k], k < 8: entries k and k + 8 added).
__device__ __forceinline__ float shfl_down16(float v, int d) { return __shfl_down_sync(kFull, v, d, 16); }
__device__ __forceinline__ float shfl_bcast16(float v) { return __shfl_sync(kFull, v, 0, 16); }
// a double moved as its two 32-bit words (the compiler's own 64-bit shuffle
// copied both halves into a new register pair at every level)
__device__ __forceinline__ double shfl_down16(double v, int d) {
    const int lo = __shfl_down_sync(kFull, __double2loint(v), d, 16);
    const int hi = __shfl_down_sync(kFull, __double2hiint(v), d, 16);
    return __hiloint2double(hi, lo);
}
__device__ __forceinline__ double shfl_bcast16(double v) {
    const int lo = __shfl_sync(kFull, __double2loint(v), 0, 16);
    const int hi = __shfl_sync(kFull, __double2hiint(v), 0, 16);
    return __hiloint2double(hi, lo);
}
template <class T>
__device__ __forceinline__ T tree_sum_half_from8(T (&b)[16]) {
#pragma unroll
    for (int k = 0; k < 4; k++) b[k] = b[k] + b[k + 4];
    b[0] = b[0] + b[2];
    b[1] = b[1] + b[3];
    b[0] = b[0] + b[1];
    T v = b[0];
#pragma unroll
    for (int h = 8; h >= 1; h >>= 1) v = v + shfl_down16(v, h);
    return shfl_bcast16(v);
}
// One pair of super-groups (p: 2 p + half is this half-warp's): its entries
// arrive in r (fetched two pairs ahead); r then takes the pair p + 2 stride.
template <int DT>
__device__ __forceinline__ void stats_pair(const DqSource& S, int64_t nsg, int centre, float* mean,
                                           float* norm2, float* sm, int lane, int half, int h, bool vec,
                                           int64_t p, int64_t npairs, int64_t stride,
                                           uint4 (&r)[StatsVec<DT>::N], unsigned long long& bad,
                                           float& warp_absmax) {
    stats_stage<DT>(sm, lane, r);
    __syncwarp();
    float v[16];
#pragma unroll
    for (int k = 0; k < 16; k++) v[k] = sm[half * kStatsRow + h + 16 * k];
    __syncwarp();
    if (p + 2 * stride < npairs) stats_fetch<DT>(S, p + 2 * stride, lane, vec, r);

    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < 16; k++) amax = fmaxf(amax, fabsf(v[k]));   // NaN ignored, like the CPU's a > m
#pragma unroll
    for (int m = 8; m >= 1; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, m));
    warp_absmax = fmaxf(warp_absmax, amax);
    float mu = 0.0f;
    if (centre) {
        float a[16];            // the mean's tree, in float32 (dq_tree_sum256f)
#pragma unroll
        for (int k = 0; k < 8; k++) a[k] = v[k] * DQ_MEAN_SCALE + v[k + 8] * DQ_MEAN_SCALE;
        mu = dq_mean_from_tree(tree_sum_half_from8(a), amax);
    }
    double b[16];
    // the squares are exact in float64 (24-bit mantissas), so the tree's
    // first level c_k^2 + c_{k+8}^2 is one fma with the same bits
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const double c = (double)(v[k] - mu), d = (double)(v[k + 8] - mu);
        b[k] = fma(c, c, d * d);
    }
    const double total = tree_sum_half_from8(b);
    // Non-finite entries, counted only where they can be: squares of
    // finite floats summed in double cannot overflow (256 * FLT_MAX^2 <
    // DBL_MAX), so a finite total means none here (the same count as a
    // test per entry, 2 instructions per entry fewer).
    if (!isfinite(total)) {
#pragma unroll
        for (int k = 0; k < 16; k++) bad += isfinite(v[k]) ? 0u : 1u;
    }
    const float f = dq_norm2_to_f32(total);
    const int64_t s = 2 * p + half;
    if (h == 0 && s < nsg) {
        if (mean) mean[s] = mu;
        norm2[s] = f;
    }
}
// BF16 sources are held to 64 registers (4 blocks per SM; unbounded they take
// 80); float32 ones keep what they need (at 64 they spill and ran 1.8x slower).
template <int DT>
__global__ void __launch_bounds__(kThreads, DT ? 4 : 1)
k_stats_pairs(const DqSource S, int64_t nsg, int centre, float* mean, float* norm2,
              unsigned long long* nonfinite, float* tail) {
    __shared__ __align__(16) float smem[kWarps][2 * kStatsRow];
    const int lane = threadIdx.x & 31, half = lane >> 4, h = lane & 15;
    float* sm = smem[threadIdx.x >> 5];
    const bool vec = (reinterpret_cast<uintptr_t>(S.x) & 15) == 0;
    const int64_t npairs = (nsg + 1) / 2;
    const int64_t stride = (int64_t)gridDim.x * kWarps;
    int64_t p = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
    unsigned long long bad = 0;
    float warp_absmax = 0.0f;
    // two buffers that take turns (two pairs ahead), so no step copies one into the other
    uint4 r0[StatsVec<DT>::N], r1[StatsVec<DT>::N];
    if (p < npairs) stats_fetch<DT>(S, p, lane, vec, r0);
    if (p + stride < npairs) stats_fetch<DT>(S, p + stride, lane, vec, r1);
    while (p < npairs) {
        stats_pair<DT>(S, nsg, centre, mean, norm2, sm, lane, half, h, vec, p, npairs, stride, r0, bad,
                       warp_absmax);
        p += stride;
        if (p >= npairs) break;
        stats_pair<DT>(S, nsg, centre, mean, norm2, sm, lane, half, h, vec, p, npairs, stride, r1, bad,
                       warp_absmax);
        p += stride;
    }
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) bad += __shfl_xor_sync(kFull, bad, m);
    if (lane == 0 && bad && nonfinite) atomicAdd(nonfinite, bad);
    warp_absmax = fmaxf(warp_absmax, __shfl_xor_sync(kFull, warp_absmax, 16));
    if (tail && lane == 0) {
        if (bad) tail[0] = 1.0f;
        if (warp_absmax > 0.0f)
            atomicMax(reinterpret_cast<unsigned int*>(tail + 1), __float_as_uint(warp_absmax));
    }
}
