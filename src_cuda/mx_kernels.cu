// mx_kernels.cu -- the MX baselines on the GPU (C API: mx_api.h).
//
// One thread handles 8 consecutive elements (a quarter of a 32-element
// block): it reads their local values with 16-byte loads, the 8 received codes
// (bits bytes), adds in float32, re-casts with the block's shared exponent and
// writes bits bytes, so a hop is one pass over the data like DynamiQ's fused
// kernel.  The element arithmetic reproduces mxfp.py's NumPy code exactly:
//  * ldexp(v, k) (C's ldexpf: the exact product rounded once, to nearest even,
//    where it is subnormal) is pow2_scaled() on the integer significand;
//  * the cast: a = min(|t|, max_normal), e = max(exponent of a, emin),
//    units = rint(a * 2^(mbits - e)) (an exact scaling, then nearest even),
//    and the code's magnitude is ((e - emin) << mbits) + units: a carry of
//    units into the next binade, or from subnormal to normal, lands on the
//    right code by itself;
//  * decoding builds the exact value M * 2^(K + X) of the code, rounded once,
//    which equals ldexp(table[code], X).
// Build flags as dq_kernels.cu (-fmad=false -ftz=false).
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>
#include "dq_codec.h"
#include "mx_api.h"

namespace {

constexpr int kThreads = 256;
#include "dq_device.cuh"      // aligned, load_source

struct MxK {
    int bits, mbits, bias, emin, emax, headroom;
    float max_normal;
};

// M * 2^K with the sign bit `sign`, rounded to nearest even into float32
// (M < 2^24; overflow gives inf, as IEEE rounding does).
__device__ __forceinline__ float pow2_scaled(uint32_t M, int K, uint32_t sign) {
    uint32_t bits = 0;
    if (M) {
        const int p = 31 - __clz(M);
        const int e = p + K;
        if (e > 127) {
            bits = 0x7F800000u;
        } else if (e >= -126) {
            bits = ((uint32_t)(e + 127) << 23) | ((M << (23 - p)) & 0x7FFFFFu);
        } else {                                  // subnormal: units of 2^-149
            const int sh = K + 149;
            if (sh >= 0) {
                bits = M << sh;
            } else if (sh > -25) {
                const int s = -sh;
                uint32_t q = M >> s;
                const uint32_t rem = M & ((1u << s) - 1u), half = 1u << (s - 1);
                if (rem > half || (rem == half && (q & 1u))) q++;
                bits = q;                         // 2^23 is the smallest normal
            }
        }
    }
    return __uint_as_float(bits | (sign << 31));
}

// ldexpf(v, k) for finite v.
__device__ __forceinline__ float scale_pow2(float v, int k) {
    const uint32_t b = __float_as_uint(v);
    const uint32_t E = (b >> 23) & 0xFFu, F = b & 0x7FFFFFu;
    return E ? pow2_scaled(F | 0x800000u, (int)E - 150 + k, b >> 31)
             : pow2_scaled(F, -149 + k, b >> 31);
}

__device__ __forceinline__ int shared_exponent(const uint8_t* reduced, int64_t block, const MxK& f) {
    const int r = __ldg(reduced + block);
    return r ? r - 127 + 1 + f.headroom - f.emax : 0;
}

// The element code of t (sign in the top bit of `bits`).
__device__ __forceinline__ uint32_t encode_element(float t, const MxK& f) {
    const uint32_t sign = __float_as_uint(t) >> 31;
    const float a = fminf(fabsf(t), f.max_normal);
    const int ea = (int)((__float_as_uint(a) >> 23) & 0xFFu) - 127;   // -127 for 0 and subnormals
    const int e = ea > f.emin ? ea : f.emin;
    const float step = __uint_as_float((uint32_t)(127 + f.mbits - e) << 23);   // 2^(mbits - e)
    const uint32_t units = (uint32_t)rintf(a * step);
    const uint32_t mag = ((uint32_t)(e - f.emin) << f.mbits) + units;
    return mag | (sign << (f.bits - 1));
}

__device__ __forceinline__ float decode_element(uint32_t c, int X, const MxK& f) {
    const uint32_t sign = (c >> (f.bits - 1)) & 1u;
    const uint32_t mag = c & ((1u << (f.bits - 1)) - 1u);
    const uint32_t ef = mag >> f.mbits, m = mag & ((1u << f.mbits) - 1u);
    const uint32_t M = ef ? (m | (1u << f.mbits)) : m;
    return pow2_scaled(M, (ef ? (int)ef : 1) - f.bias - f.mbits + X, sign);
}

// NB little-endian wire bytes at any address.
template <int NB>
__device__ __forceinline__ uint64_t load_wire(const uint8_t* p) {
    if (NB == 8 && aligned(p, 8)) return *reinterpret_cast<const uint64_t*>(p);
    if (NB == 4 && aligned(p, 4)) return *reinterpret_cast<const uint32_t*>(p);
    if (NB == 6 && aligned(p, 2)) {
        const uint16_t* q = reinterpret_cast<const uint16_t*>(p);
        return (uint64_t)q[0] | ((uint64_t)q[1] << 16) | ((uint64_t)q[2] << 32);
    }
    uint64_t w = 0;
#pragma unroll
    for (int i = 0; i < NB; i++) w |= (uint64_t)p[i] << (8 * i);
    return w;
}
template <int NB>
__device__ __forceinline__ void store_wire(uint8_t* p, uint64_t w) {
    if (NB == 8 && aligned(p, 8)) { *reinterpret_cast<uint64_t*>(p) = w; return; }
    if (NB == 4 && aligned(p, 4)) { *reinterpret_cast<uint32_t*>(p) = (uint32_t)w; return; }
    if (NB == 6 && aligned(p, 2)) {
        uint16_t* q = reinterpret_cast<uint16_t*>(p);
        q[0] = (uint16_t)w; q[1] = (uint16_t)(w >> 16); q[2] = (uint16_t)(w >> 32);
        return;
    }
#pragma unroll
    for (int i = 0; i < NB; i++) p[i] = (uint8_t)(w >> (8 * i));
}

// The 8 local values of chunk c: source elements elem_base + 8c .. + 7.
__device__ __forceinline__ void load_local(const DqSource& S, int64_t elem_base, int64_t c,
                                           float (&v)[8]) {
    const int64_t g = elem_base + 8 * c;
    load_source<8>(S, g >> 8, (int)(g & 255), v);
}

// BITS = element bits = wire bytes per chunk of 8.
template <int BITS>
__global__ void __launch_bounds__(kThreads)
k_mx_encode(const MxK f, const uint8_t* reduced, const DqSource local, int64_t elem_base,
            const uint8_t* in, int64_t nchunks, uint8_t* out) {
    for (int64_t c = (int64_t)blockIdx.x * kThreads + threadIdx.x; c < nchunks;
         c += (int64_t)gridDim.x * kThreads) {
        float v[8];
        load_local(local, elem_base, c, v);
        const int X = shared_exponent(reduced, c >> 2, f);
        if (in) {
            const uint64_t w = load_wire<BITS>(in + c * BITS);
#pragma unroll
            for (int j = 0; j < 8; j++)
                v[j] = v[j] + decode_element((uint32_t)(w >> (BITS * j)) & ((1u << BITS) - 1u), X, f);
        }
        uint64_t w = 0;
#pragma unroll
        for (int j = 0; j < 8; j++)
            w |= (uint64_t)encode_element(scale_pow2(v[j], -X), f) << (BITS * j);
        store_wire<BITS>(out + c * BITS, w);
    }
}

template <int BITS>
__global__ void __launch_bounds__(kThreads)
k_mx_decode(const MxK f, const uint8_t* reduced, const uint8_t* in, int64_t nchunks,
            const DqSource local, int use_local, int64_t elem_base, float* out, int accumulate) {
    for (int64_t c = (int64_t)blockIdx.x * kThreads + threadIdx.x; c < nchunks;
         c += (int64_t)gridDim.x * kThreads) {
        const int X = shared_exponent(reduced, c >> 2, f);
        const uint64_t w = load_wire<BITS>(in + c * BITS);
        float d[8], v[8];
#pragma unroll
        for (int j = 0; j < 8; j++)
            d[j] = decode_element((uint32_t)(w >> (BITS * j)) & ((1u << BITS) - 1u), X, f);
        float* o = out + 8 * c;
        const bool vec = aligned(o, 16);
        if (use_local) {
            load_local(local, elem_base, c, v);
        } else if (accumulate) {
            if (vec) {
                const float4 a = reinterpret_cast<const float4*>(o)[0];
                const float4 b = reinterpret_cast<const float4*>(o)[1];
                v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
                v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
            } else {
#pragma unroll
                for (int j = 0; j < 8; j++) v[j] = o[j];
            }
        }
        if (use_local || accumulate) {
#pragma unroll
            for (int j = 0; j < 8; j++) d[j] = v[j] + d[j];
        }
        if (vec) {
            reinterpret_cast<float4*>(o)[0] = make_float4(d[0], d[1], d[2], d[3]);
            reinterpret_cast<float4*>(o)[1] = make_float4(d[4], d[5], d[6], d[7]);
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++) o[j] = d[j];
        }
    }
}

// Four consecutive lanes own one block; every lane of a warp runs the same
// iterations so the shuffles see all four.
__global__ void __launch_bounds__(kThreads)
k_mx_stats(const DqSource S, int64_t nblocks, uint8_t* out) {
    const int64_t nchunks = nblocks * 4;
    const int lane = threadIdx.x & 31;
    const int64_t stride = (int64_t)gridDim.x * kThreads;
    for (int64_t base = (int64_t)blockIdx.x * kThreads + (threadIdx.x & ~31); base < nchunks;
         base += stride) {
        const int64_t c = base + lane;
        uint32_t top = 0, any = 0;              // largest exponent field, any non-zero bit
        if (c < nchunks) {
            float v[8];
            load_local(S, 0, c, v);
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const uint32_t b = __float_as_uint(v[j]) & 0x7FFFFFFFu;
                top = max(top, b >> 23);
                any |= b;
            }
        }
        top = max(top, __shfl_xor_sync(0xffffffffu, top, 1));
        top = max(top, __shfl_xor_sync(0xffffffffu, top, 2));
        any |= __shfl_xor_sync(0xffffffffu, any, 1);
        any |= __shfl_xor_sync(0xffffffffu, any, 2);
        if (c < nchunks && (c & 3) == 0)
            out[c >> 2] = (uint8_t)(top ? top : (any ? 1u : 0u));   // top is 255 for NaN/Inf
    }
}

unsigned grid_for(int64_t units) {
    static int sms[64];
    int dev = 0;
    cudaGetDevice(&dev);
    int& n = sms[dev & 63];
    if (n <= 0 && (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess
                   || n <= 0)) {
        cudaGetLastError();
        n = 132;
    }
    int64_t b = (units + kThreads - 1) / kThreads;
    const int64_t cap = (int64_t)n * 8;
    return (unsigned)(b < 1 ? 1 : (b > cap ? cap : b));
}

int make_format(const DqMxFormat& fmt, int headroom, MxK* f) {
    if ((fmt.bits != 8 && fmt.bits != 6 && fmt.bits != 4) || fmt.mbits < 1 ||
        fmt.mbits >= fmt.bits - 1 || !(fmt.max_normal > 0.0f) || headroom < 0)
        return (int)cudaErrorInvalidValue;
    f->bits = fmt.bits;
    f->mbits = fmt.mbits;
    f->bias = fmt.bias;
    f->emin = 1 - fmt.bias;
    uint32_t mb;
    memcpy(&mb, &fmt.max_normal, 4);
    f->emax = (int)((mb >> 23) & 0xFFu) - 127;
    f->headroom = headroom;
    f->max_normal = fmt.max_normal;
    return 0;
}

}  // namespace

extern "C" {

int dq_gpu_mx_stats(const DqSource* S, int64_t nblocks, uint8_t* out, uintptr_t stream) {
    if (nblocks <= 0) return 0;
    if (!S || !out || S->sg_map || S->mean) return (int)cudaErrorInvalidValue;
    k_mx_stats<<<grid_for(nblocks * 4), kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
        *S, nblocks, out);
    return (int)cudaGetLastError();
}

int dq_gpu_mx_encode(DqMxFormat fmt, const uint8_t* reduced, int32_t headroom,
                     const DqSource* local, int64_t elem_base, const uint8_t* in,
                     int64_t nblocks, uint8_t* out, uintptr_t stream) {
    if (nblocks <= 0) return 0;
    MxK f;
    if (int rc = make_format(fmt, headroom, &f)) return rc;
    if (!reduced || !local || !out || local->sg_map || local->mean || elem_base % 8)
        return (int)cudaErrorInvalidValue;
    const int64_t nchunks = nblocks * 4;
    cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
    const unsigned grid = grid_for(nchunks);
    switch (f.bits) {
        case 8: k_mx_encode<8><<<grid, kThreads, 0, st>>>(f, reduced, *local, elem_base, in, nchunks, out); break;
        case 6: k_mx_encode<6><<<grid, kThreads, 0, st>>>(f, reduced, *local, elem_base, in, nchunks, out); break;
        default: k_mx_encode<4><<<grid, kThreads, 0, st>>>(f, reduced, *local, elem_base, in, nchunks, out);
    }
    return (int)cudaGetLastError();
}

int dq_gpu_mx_decode(DqMxFormat fmt, const uint8_t* reduced, int32_t headroom, const uint8_t* in,
                     int64_t nblocks, const DqSource* local, int64_t elem_base, float* out,
                     int accumulate, uintptr_t stream) {
    if (nblocks <= 0) return 0;
    MxK f;
    if (int rc = make_format(fmt, headroom, &f)) return rc;
    if (!reduced || !in || !out || (local && (local->sg_map || local->mean)) || elem_base % 8)
        return (int)cudaErrorInvalidValue;
    DqSource none = {};
    const DqSource& src = local ? *local : none;
    const int64_t nchunks = nblocks * 4;
    cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
    const unsigned grid = grid_for(nchunks);
    const int use = local ? 1 : 0;
    switch (f.bits) {
        case 8: k_mx_decode<8><<<grid, kThreads, 0, st>>>(f, reduced, in, nchunks, src, use, elem_base, out, accumulate); break;
        case 6: k_mx_decode<6><<<grid, kThreads, 0, st>>>(f, reduced, in, nchunks, src, use, elem_base, out, accumulate); break;
        default: k_mx_decode<4><<<grid, kThreads, 0, st>>>(f, reduced, in, nchunks, src, use, elem_base, out, accumulate);
    }
    return (int)cudaGetLastError();
}

}  // extern "C"
