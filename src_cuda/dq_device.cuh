// dq_device.cuh -- device helpers shared by the kernel files (dq_kernels.cu,
// mx_kernels.cu): BF16 unpacking, 8-float loads, alignment tests and the loader of local values from a
// DqSource.  Included inside each file's anonymous namespace (internal
// linkage), after dq_codec.h.
#pragma once

// 8 BF16 values packed in a uint4 (little-endian pairs) -> 8 floats, exactly.
__device__ __forceinline__ void bf16x8_to_f32(const uint4 q, float* v) {
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        v[2 * i] = __uint_as_float(w[i] << 16);
        v[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
}

// 8 consecutive floats from a 16-byte aligned address, as two 16-byte loads.
__device__ __forceinline__ void ldg_f32x8(const float* p, float* v) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(p));
    const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

__device__ __forceinline__ bool aligned(const void* p, int a) {
    return (reinterpret_cast<uintptr_t>(p) & (uintptr_t)(a - 1)) == 0;
}
__device__ __forceinline__ uint16_t ld_u16(const uint8_t* p) {
    if (aligned(p, 2)) return *reinterpret_cast<const uint16_t*>(p);
    return (uint16_t)(p[0] | (p[1] << 8));
}
// N consecutive source values of input row `row` from element offset i0
// (dq_source_value: zero beyond length, minus mean[row] when centring).
// The mean is subtracted unconditionally (0 when there is none): v - 0 == v.
template <int N>
__device__ __forceinline__ void load_source(const DqSource& S, int64_t row, int i0, float (&x)[N]) {
    const int64_t k0 = row * DQ_SUPER + i0;
    const float m = S.mean ? __ldg(S.mean + row) : 0.0f;   // dq_source_value
    if (S.dtype) {
        const uint16_t* p = static_cast<const uint16_t*>(S.x) + k0;
        if (k0 + N <= S.length && aligned(p, 16)) {
#pragma unroll
            for (int v = 0; v < N / 8; v++) {
                bf16x8_to_f32(__ldg(reinterpret_cast<const uint4*>(p) + v), x + 8 * v);
            }
        } else {
#pragma unroll
            for (int j = 0; j < N; j++)
                x[j] = (k0 + j < S.length) ? dq_bf16_to_f32(__ldg(p + j)) : 0.0f;
        }
    } else {
        const float* p = static_cast<const float*>(S.x) + k0;
        if (k0 + N <= S.length && aligned(p, 16)) {
#pragma unroll
            for (int v = 0; v < N / 4; v++) {
                float4 q = __ldg(reinterpret_cast<const float4*>(p) + v);
                x[4 * v] = q.x; x[4 * v + 1] = q.y; x[4 * v + 2] = q.z; x[4 * v + 3] = q.w;
            }
        } else {
#pragma unroll
            for (int j = 0; j < N; j++) x[j] = (k0 + j < S.length) ? __ldg(p + j) : 0.0f;
        }
    }
    if (S.mean) {
#pragma unroll
        for (int j = 0; j < N; j++) x[j] = x[j] - m;
    }
}

__device__ __forceinline__ int64_t source_row(const DqSource& S, int64_t s) {
    return S.sg_map ? __ldg(S.sg_map + s) : s - S.sg_offset;
}

