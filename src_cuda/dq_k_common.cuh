// dq_k_common.cuh -- constants, kernel parameters, the generator's hashes, level tables in shared memory, the scale unit and code.
// A part of dq_kernels.cu (one translation unit: the parts share its anonymous
// namespace and inline into each other); included there, in order, never alone.

constexpr int kThreads = 256;               // threads per block of every kernel
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;

template <int W> struct WT;
template <> struct WT<2> { static constexpr int R = 1;   static constexpr int LUT_BITS = 0; };
template <> struct WT<4> { static constexpr int R = 7;   static constexpr int LUT_BITS = 7; };
template <> struct WT<8> { static constexpr int R = 127; static constexpr int LUT_BITS = 12; };

// Kernel parameters derived on the host from DqParams, passed by value.
struct KParams {
    uint32_t key_value, key_perm;
    const uint32_t* dkeys;               // DqParams.key_ptr: the keys in device memory, or null
    uint32_t n_events, perm_bits;
    int32_t hierarchical;
    float n_f;                           // (float)n_events
    int32_t scale_rule;                  // DqParams.scale_rule
    // entry 2k (t >= 0) and 2k+1 (t < 0), k < R:
    //   {mag[k] | mag[k+1], inv_gap[k] * 2^32, check[k], bits of R + k | R - k - 1}
    float4 tab[2 * DQ_MAX_R];
    float level[2 * DQ_MAX_R + 2];       // decode table, code -> signed level
    uint16_t lut[DQ_LUT_SIZE + 8];       // cells 0 .. 2^LUT_BITS (the last: a == 1): 32 k
};

int g_variant = 0;
int g_encode_grid_cap = 0;   // tests only (dq_gpu_set_encode_grid): 0 = the resident grid

// ---------------------------------------------------------------- hashing
// dq_mix32 with its right shifts as multiply-high (same bits).
__device__ __forceinline__ uint32_t mix32(uint32_t x) {
    x ^= __umulhi(x, 0x10000u); x *= 0x7feb352du;
    x ^= __umulhi(x, 0x20000u); x *= 0x846ca68bu;
    x ^= __umulhi(x, 0x10000u);
    return x;
}
// dq_event_uniform(key, coord, event) = mix32(mix32(coord + key) ^ E) with
// E = event * 0x9e3779b9 + 0x632be5ab.  The inner mix ends with x ^= x >> 16 and
// the outer one starts with it: that xorshift is an involution on 32 bits and
// commutes with XOR by a constant up to E -> E ^ (E >> 16), so
//   uniform = mix_tail(mix_head(coord + key) ^ Ex),  Ex = E ^ (E >> 16),
// the same bits with two xorshifts (four instructions) fewer per element.
__device__ __forceinline__ uint32_t mix_head(uint32_t x) {   // mix32 without its last xorshift
    x ^= __umulhi(x, 0x10000u); x *= 0x7feb352du;
    x ^= __umulhi(x, 0x20000u); x *= 0x846ca68bu;
    return x;
}
__device__ __forceinline__ uint32_t mix_tail(uint32_t x) {   // mix32 without its first xorshift
    x *= 0x7feb352du;
    x ^= __umulhi(x, 0x20000u); x *= 0x846ca68bu;
    x ^= __umulhi(x, 0x10000u);
    return x;
}
__host__ __device__ __forceinline__ uint32_t event_mix(uint32_t event) {
    const uint32_t E = event * 0x9e3779b9u + 0x632be5abu;
    return E ^ (E >> 16);
}
// dq_event_uniform(key, c, event) given c + key and Ex = event_mix(event).
__device__ __forceinline__ uint32_t event_uniform(uint32_t c_plus_key, uint32_t Ex) {
    return mix_tail(mix_head(c_plus_key) ^ Ex);
}
__device__ __forceinline__ uint32_t umin32(uint32_t a, uint32_t b) { return a < b ? a : b; }
// prmt.b32 (default mode): selector nibble i picks byte (nibble & 7) of {b:a}
// for result byte i, replicating that byte's sign bit when nibble & 8.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
#ifdef DQ_EMU
    uint64_t v = ((uint64_t)b << 32) | a; uint32_t r = 0;
    for (int i = 0; i < 4; i++) {
        const uint32_t n = (sel >> (4 * i)) & 15u;
        uint32_t byte = (uint32_t)(v >> (8 * (n & 7))) & 0xFFu;
        if (n & 8) byte = (byte & 0x80u) ? 0xFFu : 0u;
        r |= byte << (8 * i);
    }
    return r;
#else
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
#endif
}
// dq_lane_uniform(base, j) = base * dq_lane_mul(j): j is a compile-time constant
// in the unrolled loops, so the multiplier folds into one IMAD's immediate.
__device__ __forceinline__ uint32_t lane_uniform(uint32_t base, uint32_t j) {
    return base * dq_lane_mul(j);
}

#include "dq_device.cuh"      // aligned, ld_u16, load_source, source_row

// ---------------------------------------------------------------- tables in shared memory
// Entry e = 2k + (t < 0) of the level tables sits at byte offset off = 8e in
// both ta and tb: 8-byte strides keep a 4-bit table (14 entries, 112 bytes)
// inside the 32 banks, so the per-element loads are conflict-free.  The LUTs
// hold 16 k, the search steps by 16 and the sign adds 8.
// CELLS (the 8-bit one-step encoders): the LUT holds per cell both 16 k and the
// check value mag[k + 1] of that k, so the one-step search reads one 8-byte
// entry instead of the LUT and then the check (two loads from random banks:
// these kernels are bound by shared-memory bank conflicts).
template <int W, bool CELLS = false>
struct SmemTables {
    static constexpr int R = WT<W>::R;
    static constexpr int NLUT = (1 << WT<W>::LUT_BITS) + 1;
    using LutT = typename std::conditional<(W == 8), uint16_t, uint8_t>::type;
    float2 ta[2 * R];      // {check[k], bits of the code R + k | R - k - 1}
    float2 tb[2 * R];      // {mag[k] | mag[k+1], inv_gap[k] * 2^32}
    float level[1 << W];   // every code, the never-sent 2^W - 1 included (as the CPU reads it)
    LutT lut[CELLS ? 4 : ((NLUT + 3) & ~3)];
    float2 lutc[CELLS ? NLUT : 1];   // CELLS: {bits of 16 k(c), check[k(c)]}
    // 4-bit one-step kernels: the LUT indexed by a signed cell (see encode_group):
    // [c] = 16 k(c) + 8 (t < 0, cell c), [256 + c] = 16 k(c) (t >= 0)
    uint8_t luts[W == 4 ? 388 : 4];
};
template <int W, bool CELLS = false>
__device__ __forceinline__ void load_tables(SmemTables<W, CELLS>& sm, const KParams& kp, bool encode,
                                            bool decode) {
    constexpr int R = WT<W>::R;
    constexpr int NLUT = SmemTables<W, CELLS>::NLUT;
    if (encode) {
        for (int i = threadIdx.x; i < 2 * R; i += blockDim.x) {
            const float4 T = kp.tab[i];
            sm.ta[i] = make_float2(T.z, T.w);
            sm.tb[i] = make_float2(T.x, T.y);
        }
        if (W != 2 && !CELLS)
            for (int i = threadIdx.x; i < NLUT; i += blockDim.x)
                sm.lut[i] = (typename SmemTables<W, CELLS>::LutT)kp.lut[i];
        if (W == 4)
            for (int i = threadIdx.x; i < NLUT; i += blockDim.x) {
                sm.luts[i] = (uint8_t)(kp.lut[i] + 8u);
                sm.luts[256 + i] = (uint8_t)kp.lut[i];
            }
    }
    if (decode)
        for (int i = threadIdx.x; i < (1 << W); i += blockDim.x) sm.level[i] = kp.level[i];
    if (CELLS && encode) {
        __syncthreads();   // the checks, from ta (entry 2k holds check[k])
        for (int i = threadIdx.x; i < NLUT; i += blockDim.x) {
            const uint32_t k16 = kp.lut[i];
            sm.lutc[i] = make_float2(__uint_as_float(k16), sm.ta[(k16 >> 4) * 2].x);
        }
    }
    __syncthreads();
}

// dq_unit_bf16 (bf16_up(f32_up(max / 255.0 in double))) = the smallest BF16 b
// with b >= max / 255 (directed roundings compose; the double quotient is never
// within 2^-31 relative of a float unless equal to it).  Computed as the
// smallest b with 255 * b >= max: the products are exact in float (8 x 8
// significant bits), and the one-multiply estimate is within one BF16 step.
// Branch-free; max = 0 gives 0 (no BF16 b >= 0 is smaller).  Checked against
// dq_unit_bf16 for every non-negative float bit pattern (inf included).
__device__ __forceinline__ uint16_t unit_bf16(float m) {
    uint32_t u = __float_as_uint(m * (1.0f / 255.0f));          // >= 0
    u = (u & 0xFFFFu) ? ((u + 0x10000u) & 0xFFFF0000u) : u;      // round up to BF16
    const bool low = __uint_as_float(u) * 255.0f < m;             // one step too small
    const bool high = u >= 0x10000u && __uint_as_float(u - 0x10000u) * 255.0f >= m;
    u = low ? u + 0x10000u : (high ? u - 0x10000u : u);
    // 255 * unit must stay finite: one BF16 step down (the product is exact or inf)
    if (__uint_as_float(u) * 255.0f > 3.4028234663852886e38f) u -= 0x10000u;
    return (uint16_t)(u >> 16);
}

// dq_scale_code(s, unit) without branches.  Here s = the group max and
// unit = unit_bf16(super-group max), so unit > 0 whenever s > 0; s = 0 gives
// c = 0 (unit > 0) or ceil(0/0) = NaN (unit = 0), and both give code 0 like the
// header's early return (cvt.rzi.u32 of NaN is 0, and 0 * unit < 0 is false);
// s is never NaN or negative.  ci * unit is exact (8-bit integer times BF16).
__device__ __forceinline__ uint32_t scale_code(float s, float unit) {
    const float c = ceilf(s / unit);
    uint32_t ci = __float2uint_rz(c);
    ci += (__uint2float_rz(ci) * unit < s) ? 1u : 0u;
    return c >= 255.0f ? 255u : ci;
}
