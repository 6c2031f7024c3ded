// dq_codec.h -- the DynamiQ per-element and per-group math, shared by the CPU
// path (g++ -ffp-contract=off) and the GPU kernels (nvcc -fmad=false).
//
// Rules that keep CPU and GPU bit-identical (spec section 4):
//  * no FMA contraction, no fast-math, no flush-to-zero;
//  * no per-element transcendentals: level tables and their inverses are built
//    on the host in double and passed in as float32 (DqParams);
//  * every reduction has one fixed order, written here (dq_tree_sum256).
#pragma once
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define DQ_HD __host__ __device__ __forceinline__
#else
#include <math.h>
#define DQ_HD static inline
#endif

#define DQ_GROUP 16            // entries per group (one uint8 scale code each)
#define DQ_SUPER 256           // entries per super-group (statistics, width, BF16 unit)
#define DQ_GROUPS 16           // groups per super-group
#define DQ_MAX_R 127           // largest code radius (8-bit codes)
#define DQ_LUT_BITS 12         // level lookup table: 4096 cells over [0, 1]
#define DQ_LUT_SIZE (1 << DQ_LUT_BITS)

// Everything a codec operation needs besides the data.  Built once per
// (width, configuration, call) on the host; plain old data so it can be copied
// to the GPU's constant memory as is.
typedef struct DqParams {
    int32_t width;          // bits per code: 2, 4 or 8
    int32_t radius;         // R = 2^(width-1) - 1; codes are q + R, q in [-R, R]
    int32_t hierarchical;   // 1: uint8 group codes + BF16 unit; 0: BF16 scale per group
    int32_t correlated;     // 1: stratified uniforms across the n quantization events
    uint32_t n_events;      // n (number of events per coordinate), 1 if not correlated
    uint32_t perm_bits;     // smallest m with 2^m >= n_events
    uint32_t key_value;     // keys of the counter-based generator, per call and domain
    uint32_t key_perm;
    int32_t scale_rule;     // group codes: 0 rounded up (spec 2.7), 1 hybrid (dq_scale_code_hybrid)
    int32_t pad_;
    // GPU only: the device address of {key_value, key_perm}, read by the
    // encoders at run time instead of the two fields above (0: use those).
    // A call replayed as a CUDA graph keeps its kernels' arguments, so its
    // per-call keys travel through device memory.  The CPU ignores it.
    uint64_t key_ptr;
    float mag[DQ_MAX_R + 1];       // level magnitudes f(eps, r), r = 0..R (mag[R] = 1)
    float inv_gap[DQ_MAX_R + 1];   // 1 / (mag[r+1] - mag[r]), r = 0..R-1
    float level[2 * DQ_MAX_R + 2]; // signed level by code: level[R + q] = sign(q) mag[|q|]
    uint8_t lut[DQ_LUT_SIZE];      // lut[c] = largest r <= R-1 with mag[r] <= c / 4096
} DqParams;

// ---------------------------------------------------------------- bit casts
DQ_HD uint32_t dq_f2u(float f) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    uint32_t u; memcpy(&u, &f, 4); return u;
#endif
}
DQ_HD float dq_u2f(uint32_t u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f; memcpy(&f, &u, 4); return f;
#endif
}
DQ_HD float dq_bf16_to_f32(uint16_t h) { return dq_u2f(((uint32_t)h) << 16); }

// Round a non-negative finite float up to BF16, saturating at the largest
// finite BF16 (only values above it, within 0.4% of FLT_MAX, saturate).
DQ_HD uint16_t dq_f32_to_bf16_up(float f) {
    uint32_t u = dq_f2u(f);
    if (u & 0xFFFFu) u = (u + 0x10000u) & 0xFFFF0000u;
    if (u >= 0x7F800000u) u = 0x7F7F0000u;
    return (uint16_t)(u >> 16);
}

// Round a non-negative double up to float32 (exact round toward +inf).
DQ_HD float dq_f64_to_f32_up(double v) {
#ifdef __CUDA_ARCH__
    return __double2float_ru(v);
#else
    float f = (float)v;
    if ((double)f < v) f = nextafterf(f, INFINITY);
    return f;
#endif
}

// ---------------------------------------------------------------- generator
// A cheap counter-based hash: two multiply-xorshift rounds.  Keys are derived on
// the host per (seed, call counter, domain); a uniform is a pure function of
// (key, coordinate, event), so no random pool is ever stored.
DQ_HD uint32_t dq_mix32(uint32_t x) {
    x ^= x >> 16; x *= 0x7feb352du;
    x ^= x >> 15; x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}
// Fresh 32-bit uniform for one (coordinate, event).
DQ_HD uint32_t dq_event_uniform(uint32_t key, uint32_t coord, uint32_t event) {
    return dq_mix32(dq_mix32(coord + key) ^ (event * 0x9e3779b9u + 0x632be5abu));
}

// Keyed pseudo-random permutation of 0..n-1 (n <= 2^perm_bits): a 12-round
// unbalanced Feistel network over perm_bits bits, with cycle walking so the
// result stays below n.  h seeds the round functions.  One permutation serves
// a whole super-group (dq_sg_sigma), so a kernel computes it once per 256
// coordinates and can afford 12 rounds: with the offsets below, the law of a
// pair (pi(i), pi(j)) of one coordinate at n = 8 is within [0.96, 1.08] of
// uniform with 12 rounds, [0.71, 1.59] with 6 (tests/test_codec_generator.py).
// dq_encode_lane adds a uniform cyclic offset per coordinate: that makes the
// stratum of every event exactly uniform (each quantization stays unbiased)
// while the Feistel part keeps the joint law far from a mere cyclic shift.
#define DQ_FEISTEL_ROUNDS 12u
DQ_HD uint32_t dq_feistel_round(uint32_t h, uint32_t round, uint32_t v) {
    uint32_t t = (v + 1u) * 0x9e3779b1u ^ (h + round * 0x85ebca77u);
    t ^= t >> 15; t *= 0x2c1b3c6du; t ^= t >> 12; t *= 0x297a2d39u; t ^= t >> 15;
    return t;
}
DQ_HD uint32_t dq_permute(uint32_t x, uint32_t n, uint32_t bits, uint32_t h) {
    if (n <= 1u) return 0u;
    const uint32_t lo_bits = bits >> 1, hi_bits = bits - lo_bits;
    const uint32_t lo_mask = (1u << lo_bits) - 1u, hi_mask = (1u << hi_bits) - 1u;
    do {
        uint32_t lo = x & lo_mask, hi = x >> lo_bits;
        for (uint32_t r = 0; r < DQ_FEISTEL_ROUNDS; r += 2u) {
            lo ^= dq_feistel_round(h, r, hi) & lo_mask;
            hi ^= dq_feistel_round(h, r + 1u, lo) & hi_mask;
        }
        x = (hi << lo_bits) | lo;
    } while (x >= n);
    return x;
}

// Decide "round toward +inf" with probability p, for uniform u = (pi + g)/n
// (g = g32 / 2^32): true iff u < p  <=>  g < n p - pi.  With n = 1, pi = 0 this
// is plain stochastic rounding.  Written as separate float operations so no
// compiler can fuse them.
DQ_HD int dq_round_up(float p, uint32_t g32, uint32_t pi, uint32_t n) {
    float np = (float)n * p;
    float thr = np - (float)pi;
    if (thr >= 1.0f) return 1;
    if (!(thr > 0.0f)) return 0;
    float scaled = thr * 4294967296.0f;  // exact: power-of-two scaling, < 2^32
    return g32 < (uint32_t)scaled;
}

// ---------------------------------------------------------------- quantizer
// Normalise x by the group scale s (> 0).  Scales below the smallest normal are
// pre-multiplied by 2^64 (exactly) so the reciprocal stays finite.
struct DqNorm { float pre; float inv; };
DQ_HD DqNorm dq_norm_for_scale(float s) {
    DqNorm r; r.pre = 1.0f;
    if (s < 1.17549435e-38f) { r.pre = 18446744073709551616.0f; s = s * r.pre; }
    r.inv = 1.0f / s;
    return r;
}

// Quantize t = x / scale (|t| <= 1 up to rounding) to a code in [0, 2R] with
// unbiased stochastic rounding in value space between adjacent levels.
// u_* describe the uniform (see dq_round_up).
DQ_HD uint32_t dq_quantize(const DqParams* P, float x, DqNorm nm,
                           uint32_t g32, uint32_t pi, uint32_t n) {
    const int R = P->radius;
    // a = |t| clamped to [0, 1], t = x / scale, as one saturating multiply on the GPU:
    // |x pre| inv = |(x pre) inv| (round to nearest is symmetric), and a NaN (an inf
    // over an inf scale; the engine never quantizes non-finite input) becomes 0, the
    // zero code.  The side is the sign of x (= that of t: pre, inv > 0).
    float a = fabsf(x * nm.pre) * nm.inv;
    if (!(a <= 1.0f)) a = (a > 1.0f) ? 1.0f : 0.0f;
    float cellf = a * (float)DQ_LUT_SIZE;
    int cell = (int)cellf;
    if (cell > DQ_LUT_SIZE - 1) cell = DQ_LUT_SIZE - 1;
    int k = P->lut[cell];
    while (k < R - 1 && a >= P->mag[k + 1]) k++;
    if (x < 0.0f) {
        // interval [-mag[k+1], -mag[k]]: "up" is toward -mag[k]
        float p = (P->mag[k + 1] - a) * P->inv_gap[k];
        int up = dq_round_up(p, g32, pi, n);
        return (uint32_t)(R - (k + 1) + up);
    } else {
        float p = (a - P->mag[k]) * P->inv_gap[k];
        int up = dq_round_up(p, g32, pi, n);
        return (uint32_t)(R + k + up);
    }
}

// Dequantize one code with a decoded group scale.
DQ_HD float dq_dequantize(const DqParams* P, uint32_t code, float scale) {
    return P->level[code] * scale;
}

// ---------------------------------------------------------------- scales
// BF16 unit of a super-group: bf16_up(max_group_scale / 255), computed in double
// and rounded up so that every group code is <= 255.  0 for an all-zero block.
// Within 0.4 % of FLT_MAX the unit steps one BF16 ulp down so that 255 * unit
// stays finite; codes there saturate at 255 (a bias confined to that edge).
DQ_HD uint16_t dq_unit_bf16(float max_scale) {
    if (!(max_scale > 0.0f)) return 0;
    double v = (double)max_scale / 255.0;
    uint16_t u = dq_f32_to_bf16_up(dq_f64_to_f32_up(v));
    if ((double)dq_bf16_to_f32(u) * 255.0 > 3.4028234663852886e38) u = (uint16_t)(u - 1u);
    return u;
}

// Deterministic uint8 group code (spec 2.7): the smallest c with c * unit >= s,
// so the decoded scale c * unit (exact: an 8-bit integer times a BF16) is never
// below the group max and normalised values stay in [-1, 1]; 0 for an all-zero
// group.  For these operands a correctly rounded s / unit never rounds down
// onto an integer, so ceilf is exact; the exact product check makes the
// definition hold by construction, whatever the division did.  Saturates
// at 255 only where the unit stepped down near FLT_MAX (dq_unit_bf16).
DQ_HD uint32_t dq_scale_code(float s, float unit) {
    if (!(s > 0.0f) || !(unit > 0.0f)) return 0u;
    float c = ceilf(s / unit);
    if (c >= 255.0f) return 255u;
    uint32_t ci = (uint32_t)c;
    if ((float)ci * unit < s) ci += 1u;
    return ci;
}

// Hybrid group code (DynamiQ(scale_code="hybrid"), a proposed change to spec
// 2.7).  The rounded-up code ratchets the scales of a long ring upwards: a
// value decoded at the top level lies above the group max it came from, is
// the next hop's max, and is rounded up again (docs/error-study.md).  So
// where the rounded-up code c is >= DQ_HYBRID_MIN, the code is floor(f) or
// floor(f) + 1 with f = RN(s / unit), the latter with probability f - floor(f)
// (u32: a fresh uniform of this group and event), so E[code * unit] = f * unit
// ~ s, and values are normalised by s itself (within [-1, 1]); the relative
// noise of such a scale is below 1 / 128.  Below, the rounded-up code.
// Returns the code and writes the scale the values are normalised by.  The
// comparison is exact: u32 >> 8 < 2^24 and frac * 2^24 (f < 256 carries at
// most 17 fraction bits) are integers in float32.
#define DQ_HYBRID_MIN 128u
#define DQ_HYBRID_KEY 0x5ca1ab1eu      // the code's uniform: key_value ^ this
DQ_HD uint32_t dq_scale_code_hybrid(float s, float unit, uint32_t u32, float* norm) {
    uint32_t c = dq_scale_code(s, unit);
    if (c < DQ_HYBRID_MIN) {
        *norm = (float)c * unit;
        return c;
    }
    float f = s / unit;
    float fl = floorf(f);
    float frac = f - fl;
    uint32_t code = (uint32_t)fl + (((float)(u32 >> 8) < frac * 16777216.0f) ? 1u : 0u);
    if (code > 255u) code = 255u;      // only where the unit stepped down near FLT_MAX
    *norm = s;
    return code;
}

// ---------------------------------------------------------------- packing
// Codes are little-endian within a byte, in coordinate order: code j of a
// 16-entry group sits in byte (j * width) / 8 at bit (j * width) % 8.
DQ_HD uint32_t dq_unpack_code(const uint8_t* group_codes, int width, int j) {
    int bit = j * width;
    uint32_t byte = group_codes[bit >> 3];
    return (byte >> (bit & 7)) & ((1u << width) - 1u);
}

// ---------------------------------------------------------------- reductions
// The one summation order for 256 values: a halving tree,
// v[i] += v[i + h] for h = 128, 64, ..., 1.  (A warp holding v[lane + 32 k]
// reproduces it with in-register adds for h >= 32, then shuffles.)
DQ_HD double dq_tree_sum256(double* v) {
    for (int h = 128; h >= 1; h >>= 1)
        for (int i = 0; i < h; i++) v[i] = v[i] + v[i + h];
    return v[0];
}

// The same tree in float32: the mean of a super-group is the tree sum of its
// values scaled by 2^-8 (exact but for denormals; no partial sum can overflow
// where the mean is taken, |x| <= FLT_MAX / 2).  float32, not the norm's
// float64: the mean only has to be the same on every device (centring is
// undone exactly by the sum of the means), and the statistics pass runs at
// the speed of its float64 conversions (kernels.md).
#define DQ_MEAN_SCALE 0.00390625f
DQ_HD float dq_tree_sum256f(float* v) {
    for (int h = 128; h >= 1; h >>= 1)
        for (int i = 0; i < h; i++) v[i] = v[i] + v[i + h];
    return v[0];
}

// Mean of a super-group from its scaled tree sum; 0 (no centring) when a value
// above FLT_MAX / 2 could make x - mean overflow.
DQ_HD float dq_mean_from_tree(float scaled_sum, float absmax) {
    if (!(absmax <= 1.7014118e38f)) return 0.0f;
    return scaled_sum;
}

// Saturating float32 of a non-negative double, rounded up (F is never 0 for a
// non-zero block and never inf for a finite one).
DQ_HD float dq_norm2_to_f32(double s) {
    if (s > 3.4028234663852886e38) return 3.4028234663852886e38f;
    return dq_f64_to_f32_up(s);
}

// Wire sizes (bytes) of one super-group of the given width.
DQ_HD int dq_codes_bytes(int width) { return DQ_SUPER * width / 8; }
DQ_HD int dq_record_bytes(int width, int hierarchical) {
    return hierarchical ? dq_codes_bytes(width) + DQ_GROUPS + 2
                        : dq_codes_bytes(width) + 2 * DQ_GROUPS;
}

// ---------------------------------------------------------------- per event
// Everything random about one quantization event lives here, so the CPU
// loops and the GPU kernels draw exactly the same uniforms.
//   group: the group's index in the reordered stream (coordinate >> 4), the same
//          on every rank; j: the coordinate's lane in the group (coordinate & 15)
//   event: the quantizing rank's role in the chunk's reduction tree
//
// Cost matters (the fused kernel has a budget of a few dozen instructions per
// element), so the full hash runs once per (group, event) and each lane derives
// its uniform with one multiplication by its own odd constant
// (dq_lane_uniform).  Each lane's uniform is a bijection of a uniform base, so
// it is exactly uniform; across events of a coordinate the bases are
// independent hashes.  Lanes of one group are fixed functions of one base (one
// lane determines the others), which changes neither the unbiasedness nor the
// expected squared error (both are sums over coordinates of per-coordinate
// quantities); odd multipliers keep pairs of lanes close to independent (the
// 16 x 16 histogram of the top 4 bits of two lanes over 2^20 bases: chi-square
// at most ~330 against 255 degrees of freedom, tests/test_codec_generator.py).
// (The low k bits of every lane's uniform are a function of the base's low k
// bits alone, as in any multiplication; a rounding decision reads the high
// bits, and the low ones only break ties of the high 32 - k.)
//
// Correlated rounding: the stratum of this rank's event for a coordinate is
// pi = (sigma_S(event) + shift) mod n, sigma_S a keyed Feistel permutation shared
// by the super-group S = group >> 4 (dq_sg_sigma: computed once per 256
// coordinates), shift uniform per coordinate and the same for every event (so pi
// is exactly uniform: each quantization is unbiased on its own, and every
// coordinate's events take distinct strata).
typedef struct DqGroupRng {
    uint32_t value_base;   // value rounding, per (group, event)
    uint32_t shift_base;   // correlated rounding: per group, the same for all events
    uint32_t sigma;        // correlated rounding: sigma_S(event) of the group's super-group
} DqGroupRng;

// Lane j's odd multiplier (a compile-time constant where j is one).
DQ_HD uint32_t dq_lane_mul(uint32_t j) { return dq_mix32(j * 0x9e3779b9u + 0x632be5abu) | 1u; }
DQ_HD uint32_t dq_lane_uniform(uint32_t base, uint32_t j) { return base * dq_lane_mul(j); }
// sigma_S(event) of super-group S (the kernels batch it by S; S = group >> 4).
DQ_HD uint32_t dq_sigma(uint32_t event, uint32_t n, uint32_t bits, uint32_t key_perm, uint32_t S) {
    return dq_permute(event, n, bits, dq_mix32(S ^ key_perm));
}
// sigma_S(event) for the super-group of `group` (0 unless correlated).
DQ_HD uint32_t dq_sg_sigma(const DqParams* P, uint32_t group, uint32_t event) {
    if (!P->correlated) return 0u;
    return dq_sigma(event, P->n_events, P->perm_bits, P->key_perm, group >> 4);
}
// The group's generator state given its super-group's sigma (dq_sg_sigma).
DQ_HD DqGroupRng dq_group_rng(const DqParams* P, uint32_t group, uint32_t event, uint32_t sigma) {
    DqGroupRng r;
    r.value_base = dq_event_uniform(P->key_value, group, event);
    r.shift_base = 0u;
    r.sigma = 0u;
    if (P->correlated) {
        r.shift_base = dq_mix32(group ^ P->key_perm ^ 0xbb67ae85u);
        r.sigma = sigma;
    }
    return r;
}
DQ_HD uint32_t dq_encode_lane(const DqParams* P, float x, DqNorm nm, DqGroupRng r, uint32_t j) {
    uint32_t g32 = dq_lane_uniform(r.value_base, j);
    uint32_t pi = 0u, n = 1u;
    if (P->correlated) {
        n = P->n_events;
        uint32_t shift = (uint32_t)(((uint64_t)dq_lane_uniform(r.shift_base, j) * (uint64_t)n) >> 32);
        pi = r.sigma + shift;
        if (pi >= n) pi -= n;
    }
    return dq_quantize(P, x, nm, g32, pi, n);
}
// Round float32 to BF16, nearest-even (finite inputs; NaN stays NaN).
DQ_HD uint16_t dq_f32_to_bf16_rne(float f) {
    uint32_t u = dq_f2u(f);
    if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x7FFFFFu)) return (uint16_t)((u >> 16) | 0x40u);
    u = u + 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

// ---------------------------------------------------------------- sources
// Where a codec operation reads its local values from, so compress and the
// fused step read the caller's buffer directly (float32 or BF16), gathered by
// super-group into width order and centred on the fly, with no staging copy.
// Stream super-group s reads input super-group row = sg_map ? sg_map[s] : s - sg_offset;
// element i of it is x[row * 256 + i] (0 beyond `length`) minus mean[row].
typedef struct DqSource {
    const void* x;
    int32_t dtype;          // 0: float32, 1: bfloat16
    int64_t length;         // valid elements of x
    const int64_t* sg_map;  // NULL: identity (with sg_offset)
    int64_t sg_offset;
    const float* mean;      // NULL: no centring
} DqSource;

DQ_HD int64_t dq_source_row(const DqSource* S, int64_t s) {
    return S->sg_map ? S->sg_map[s] : s - S->sg_offset;
}
DQ_HD float dq_source_value(const DqSource* S, int64_t row, int i) {
    int64_t k = row * DQ_SUPER + i;
    float v = 0.0f;
    if (k < S->length)
        v = S->dtype ? dq_bf16_to_f32(((const uint16_t*)S->x)[k]) : ((const float*)S->x)[k];
    if (S->mean) v = v - S->mean[row];
    return v;
}
