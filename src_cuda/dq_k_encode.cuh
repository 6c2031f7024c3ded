// dq_k_encode.cuh -- the encoders: compress and the fused decompress-accumulate-recompress (dar).
// A part of dq_kernels.cu (one translation unit: the parts share its anonymous
// namespace and inline into each other); included there, in order, never alone.

// Encode the 16 values x of group g (stream group index `group`) to its wire
// location L.  All 32 lanes must call it (it shuffles); lanes with
// valid == false store nothing.
template <int W, bool CORR, bool ONESTEP>
__device__ __forceinline__ void encode_group(const KParams& kp,
                                             const SmemTables<W, (W == 8 && ONESTEP)>& sm,
                                             float (&x)[16], uint8_t* out, const WireLoc<W>& L,
                                             const WireAlign& A, uint32_t group, int g, bool valid,
                                             uint32_t Ex, uint32_t key_value,
                                             uint32_t key_perm, uint32_t sigma) {
    // group maximum, then the super-group maximum over the 16 lanes of this half
    float gm = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; j++) gm = fmaxf(gm, fabsf(x[j]));
    float smax = gm;
    smax = fmaxf(smax, __shfl_xor_sync(kFull, smax, 1));
    smax = fmaxf(smax, __shfl_xor_sync(kFull, smax, 2));
    smax = fmaxf(smax, __shfl_xor_sync(kFull, smax, 4));
    smax = fmaxf(smax, __shfl_xor_sync(kFull, smax, 8));

    float ns;   // the scale the group's values are normalised by
    if (kp.hierarchical) {
        const uint16_t unit_bits = unit_bf16(smax);
        const float unit = dq_bf16_to_f32(unit_bits);
        // dq_scale_code; values are normalised by the decoded scale (spec 2.7)
        uint32_t gcode = scale_code(gm, unit);
        ns = __uint2float_rz(gcode) * unit;
        if (kp.scale_rule == 1 && gcode >= DQ_HYBRID_MIN) {   // dq_scale_code_hybrid
            const uint32_t u = event_uniform(group + (key_value ^ DQ_HYBRID_KEY), Ex);
            const float f = gm / unit;
            const float fl = floorf(f);
            const float frac = f - fl;
            gcode = (uint32_t)fl + (((float)(u >> 8) < frac * 16777216.0f) ? 1u : 0u);
            gcode = gcode > 255u ? 255u : gcode;
            ns = gm;
        }
        if (valid) {
            out[L.gmeta] = (uint8_t)gcode;
            if (g == 0) st_u16a(out + L.unit, unit_bits, A.unit);
        }
    } else {
        const uint16_t b = gm > 0.0f ? dq_f32_to_bf16_up(gm) : (uint16_t)0;
        if (valid) st_u16a(out + L.gmeta, b, A.meta2);
        ns = dq_bf16_to_f32(b);
    }
    // dq_norm_for_scale; an all-zero group gets inv = 0, so t = +-0 and every
    // code is R (the header's explicit zero code), with no branch.
    float inv = 0.0f;
    if (ns > 0.0f) {
        if (ns < 1.17549435e-38f) {
            ns = ns * 18446744073709551616.0f;
#pragma unroll
            for (int j = 0; j < 16; j++) x[j] = x[j] * 18446744073709551616.0f;
        }
        inv = 1.0f / ns;
    }

    constexpr int SHIFT = 23 - WT<W>::LUT_BITS;
    // lut[(bits(RZ(1 + a)) >> SHIFT) - (bits(1.0f) >> SHIFT)] = lut[floor(a * 2^LUT_BITS)]
    constexpr uint32_t LUT_ORIGIN = 0x3F800000u >> SHIFT;
    // 4-bit one-step: the signed LUT (no sign test, see below)
    constexpr bool SLUT = (W == 4) && ONESTEP;
    const char* tab_a = reinterpret_cast<const char*>(sm.ta);
    const char* tab_b = reinterpret_cast<const char*>(sm.tb);
    // dq_group_rng(P, group, event, sigma): the full hashes once per (group,
    // event), i.e. once per lane; each element then takes one multiplication.
    // sigma (the super-group's permutation) comes from the caller's batch.
    const uint32_t vbase = event_uniform(group + key_value, Ex);
    uint32_t sbase = 0u;
    if (CORR) sbase = mix32(group ^ key_perm ^ 0xbb67ae85u);
    uint32_t cw[W / 2];
#pragma unroll
    for (int i = 0; i < W / 2; i++) cw[i] = 0u;
#pragma unroll
    for (int j = 0; j < 16; j++) {
        // a = |t| clamped to [0, 1], NaN -> 0 (the header's), t = x / scale
        float a;
        uint32_t off;
        if (SLUT) {
            // One saturating multiply.  The byte 1 of bits(RZ(a + 256)) is floor(a *
            // 128) (128 for a = 1), and prmt appends the sign of x (the header's side,
            // x < 0): idx = cell - 256 * (x has its sign bit).  x = -0 and a NaN with
            // its sign bit so take the x < 0 entry k = 0 with a = 0, whose p =
            // RN(mag[1] * inv_gap[0]) >= 1 (host_build checks it, else the generic
            // kernel runs): the code is R - 1 + 1 = R, the header's.
            a = __saturatef(fabsf(x[j]) * inv);
            const int idx = (int)prmt(__float_as_uint(__fadd_rz(a, 256.0f)), __float_as_uint(x[j]), 0xFFF1u);
            off = sm.luts[256 + idx];
        } else {
            // (here the product first: reading x twice made the 2- and 8-bit kernels spill)
            const float t = x[j] * inv;
            a = __saturatef(fabsf(t));
            const uint32_t cell = (__float_as_uint(__fadd_rz(a, 1.0f)) >> SHIFT) - LUT_ORIGIN;
            float chk = 0.0f;
            if (W == 8 && ONESTEP) {        // 16 k and its check in one load
                const float2 lc = sm.lutc[cell];
                off = __float_as_uint(lc.x);
                chk = lc.y;
            } else {
                off = (W == 2) ? 0u : (uint32_t)sm.lut[cell];
            }
            // the side, x < 0.  One-step tables take the sign bit of t instead: it
            // differs only for -0 and a NaN, where a = 0 and p = RN(mag[1] inv_gap[0])
            // >= 1 (host_build checks it) give code R on either side.
            if (ONESTEP ? (__float_as_int(t) < 0) : (x[j] < 0.0f)) off += 8u;
            if (W == 8 && ONESTEP && a >= chk) off += 16u;
        }
        if (W != 2 && !(W == 8 && ONESTEP)) {
            if (ONESTEP) {
                if (a >= *reinterpret_cast<const float*>(tab_a + off)) off += 16u;
            } else {
                while (a >= *reinterpret_cast<const float*>(tab_a + off)) off += 16u;
            }
        }
        const float2 T = *reinterpret_cast<const float2*>(tab_b + off);
        // the code of entry e = off / 8 = 2k + (t < 0): R + k, or R - k - 1.  8-bit
        // kernels are bound by shared-memory bank conflicts (random entries of a
        // 254-entry table), so they compute it (3 ALU operations for a conflicted load)
        const uint32_t code = (W == 8) ? ((off & 8u) ? (uint32_t)(WT<W>::R - 1) - (off >> 4)
                                                     : (uint32_t)WT<W>::R + (off >> 4))
                                       : *reinterpret_cast<const uint32_t*>(tab_a + off + 4);
        float S = fabsf(a - T.x) * T.y;                 // p * 2^32
        if (!ONESTEP) S = S * 4294967296.0f;            // generic tables: T.y = inv_gap
        const uint32_t g32 = lane_uniform(vbase, (uint32_t)j);
        bool up;
        if (CORR) {
            // dq_encode_lane: shift = (lane_uniform(shift_base, j) * n) >> 32,
            // pi = sigma + shift mod n (both < n: one conditional subtraction, as min)
            const uint32_t sft = __umulhi(lane_uniform(sbase, (uint32_t)j), kp.n_events);
            const uint32_t s0 = sigma + sft;
            const uint32_t pi = umin32(s0, s0 - kp.n_events);
            // dq_round_up with Q = RN(n p): the header rounds up iff RN(Q - pi) >= 1, or
            // > 0 and g32 < trunc(RN(Q - pi) 2^32).  Q - pi is exact whenever pi <= Q
            // (an integer off a float below 2^24 keeps its fraction bits), so that is
            // pi < floor(Q), or pi = floor(Q) and g32 < trunc(frac(Q) 2^32): exactly
            // the 64-bit comparison (pi 2^32 + g32) < trunc(Q 2^32), two integer
            // compares after one conversion (the fma, the int-to-float and the float
            // test are gone).  Q 2^32 < 2^56 is exact scaling; a negative RN(Q - pi)
            // (pi > Q) and pi 2^32 > Q 2^32 both round down.
            const unsigned long long q = __float2ull_rz(kp.n_f * S);   // trunc(n p 2^32)
            up = ((((unsigned long long)pi) << 32) | g32) < q;
        } else {
            const uint32_t lim = __float2uint_rz(S);
            up = (S >= 4294967296.0f) | (g32 < lim);
        }
        cw[(j * W) >> 5] += code << ((j * W) & 31);
        if (up) cw[(j * W) >> 5] += 1u << ((j * W) & 31);
    }
    if (valid) {
        uint8_t* p = out + L.codes;
        if (A.codes) {
            if (W == 2) *reinterpret_cast<uint32_t*>(p) = cw[0];
            else if (W == 4) *reinterpret_cast<uint2*>(p) = make_uint2(cw[0], cw[W / 2 > 1 ? 1 : 0]);
            else *reinterpret_cast<uint4*>(p) = make_uint4(cw[0], cw[W / 2 > 1 ? 1 : 0],
                                                           cw[W / 2 > 2 ? 2 : 0], cw[W / 2 > 3 ? 3 : 0]);
        } else {
#pragma unroll
            for (int i = 0; i < W / 2; i++) {
                p[4 * i] = (uint8_t)cw[i]; p[4 * i + 1] = (uint8_t)(cw[i] >> 8);
                p[4 * i + 2] = (uint8_t)(cw[i] >> 16); p[4 * i + 3] = (uint8_t)(cw[i] >> 24);
            }
        }
    }
}

// ---------------------------------------------------------------- kernels
// One lane's inputs for one step (its group of one super-group), fetched a step
// ahead so the loads of step i+1 are in flight while step i computes.
template <int W, int DT, bool DAR>
struct Fetched {
    uint32_t raw[DT ? 8 : 16];     // BF16 pairs (little-endian) or float32 bits
    float mean;
    uint32_t cw[W / 2];            // DAR: the incoming group's packed codes
    float scale;                   // DAR: its decoded scale
};

// fast: the source rows below full_rows are whole and 16-byte aligned (else 0)
template <int W, int DT, bool DAR>
__device__ __forceinline__ void fetch(Fetched<W, DT, DAR>& F, const KParams& kp, const DqSource& src,
                                      bool has_map, bool has_mean,
                                      const uint8_t* in, const WireLoc<W>& Lin, const WireAlign& Ain,
                                      int64_t sidx, int g, int64_t full_rows) {
    const int64_t row = has_map ? __ldg(src.sg_map + sidx) : sidx - src.sg_offset;
    F.mean = has_mean ? __ldg(src.mean + row) : 0.0f;
    const int64_t k0 = row * DQ_SUPER + g * DQ_GROUP;
    const bool fast = (uint64_t)row < (uint64_t)full_rows;
    if (DT) {
        const uint16_t* p = static_cast<const uint16_t*>(src.x) + k0;
        if (fast) {
            const uint4 a = __ldg(reinterpret_cast<const uint4*>(p));
            const uint4 b = __ldg(reinterpret_cast<const uint4*>(p) + 1);
            F.raw[0] = a.x; F.raw[1] = a.y; F.raw[2] = a.z; F.raw[3] = a.w;
            F.raw[4] = b.x; F.raw[5] = b.y; F.raw[6] = b.z; F.raw[7] = b.w;
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const uint32_t lo = (k0 + 2 * i < src.length) ? __ldg(p + 2 * i) : 0u;
                const uint32_t hi = (k0 + 2 * i + 1 < src.length) ? __ldg(p + 2 * i + 1) : 0u;
                F.raw[i] = lo | (hi << 16);
            }
        }
    } else {
        const float* p = static_cast<const float*>(src.x) + k0;
        if (fast) {
#pragma unroll
            for (int v = 0; v < 4; v++) {
                const uint4 q = __ldg(reinterpret_cast<const uint4*>(p) + v);
                F.raw[4 * v] = q.x; F.raw[4 * v + 1] = q.y; F.raw[4 * v + 2] = q.z; F.raw[4 * v + 3] = q.w;
            }
        } else {
#pragma unroll
            for (int j = 0; j < 16; j++)
                F.raw[j] = (k0 + j < src.length) ? __float_as_uint(__ldg(p + j)) : 0u;
        }
    }
    if (DAR) read_group<W>(in, Lin, Ain, kp.hierarchical, F.cw, F.scale);
}

// MINB: blocks per SM to build for (0: 4 for BF16 sources, whose kernels fit
// 64 registers without spilling; the float32 ones take what they need).
template <int W, int DT, bool CORR, bool DAR, bool ONESTEP, int MINB = 0>
__global__ void __launch_bounds__(kThreads, MINB ? MINB : (DT ? 4 : 1))
k_encode(const __grid_constant__ KParams kp, const DqSource src, const uint8_t* in, uint8_t* out,
         int64_t nsg, int64_t sg_base, uint32_t event, const int64_t* piece) {
    // a piece read from the device (the fixed layout: {first stream super-group,
    // count, byte offset in the tile}); nsg was only its capacity, for the grid
    if (piece) {
        sg_base = __ldg(piece);
        nsg = __ldg(piece + 1);
        in += __ldg(piece + 2);
        out += __ldg(piece + 2);
    }
    __shared__ SmemTables<W, (W == 8 && ONESTEP)> sm;
    load_tables<W, (W == 8 && ONESTEP)>(sm, kp, true, DAR);
    const int lane = threadIdx.x & 31;
    const int g = lane & 15;
    const int half = lane >> 4;
    const int64_t npairs = (nsg + 1) >> 1;
    const uint32_t Ex = event_mix(event);
    // the call's keys: kernel arguments, or device memory when the call is a
    // graph replayed with new keys (DqParams.key_ptr)
    const uint32_t key_value = kp.dkeys ? __ldg(kp.dkeys) : kp.key_value;
    const uint32_t key_perm = kp.dkeys ? __ldg(kp.dkeys + 1) : kp.key_perm;
    const int64_t stride = (int64_t)gridDim.x * kWarps;
    int64_t pair = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
    // rows whose 256 values are all inside the source and 16-byte aligned (vector loads)
    const int64_t full_rows = aligned(src.x, 16) ? src.length / DQ_SUPER : 0;
    const bool has_map = src.sg_map != nullptr, has_mean = src.mean != nullptr;
    const int hier = kp.hierarchical;
    // this lane's super-group s = 2 pair + half, advanced by ds per step
    const int64_t ds = 2 * stride;
    int64_t s = 2 * pair + half;
    const int64_t d_codes = ds * (32 * W), d_gmeta = ds * (hier ? DQ_GROUPS : 2 * DQ_GROUPS),
                  d_unit = 2 * ds;
    // wire offsets of the current step (L) and of the prefetched one (Ln, dar)
    WireLoc<W> L;
    L.init(nsg, s, g, hier);
    WireLoc<W> Ln = L;
    const WireAlign Aout = wire_align<W>(out, nsg);
    WireAlign Ain = {};
    if (DAR) Ain = wire_align<W>(in, nsg);
    Fetched<W, DT, DAR> cur = {};
    if (pair < npairs && s < nsg)
        fetch<W, DT, DAR>(cur, kp, src, has_map, has_mean, in, L, Ain, sg_base + s, g, full_rows);
    // correlated rounding: sigma_S(event) of the super-groups of this half's next
    // 16 steps, lane g holding step g's (dq_sg_sigma), so the Feistel network runs
    // once per 16 steps per lane instead of once per group
    uint32_t sig_batch = 0u;
    for (uint32_t it = 0; pair < npairs; pair += stride, ++it) {
        const bool valid = s < nsg;
        const int64_t sidx = sg_base + s;
        uint32_t sigma = 0u;
        if (CORR) {
            if ((it & 15u) == 0u) {
                const uint32_t S = (uint32_t)(sidx + (int64_t)g * ds) & 0x0FFFFFFFu;   // (group >> 4)
                sig_batch = dq_sigma(event, kp.n_events, kp.perm_bits, key_perm, S);
            }
            sigma = __shfl_sync(kFull, sig_batch, (lane & 16) | (int)(it & 15u));
        }
        // (a lane of a missing super-group works on whatever it holds and stores nothing)
        float x[16];
        {
            if (DT) {
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    x[2 * i] = __uint_as_float(cur.raw[i] << 16);
                    x[2 * i + 1] = __uint_as_float(cur.raw[i] & 0xFFFF0000u);
                }
            } else {
#pragma unroll
                for (int j = 0; j < 16; j++) x[j] = __uint_as_float(cur.raw[j]);
            }
            if (has_mean) {   // dq_source_value: v - mean[row]
#pragma unroll
                for (int j = 0; j < 16; j++) x[j] = x[j] - cur.mean;
            }
            if (DAR) {
#pragma unroll
                for (int j = 0; j < 16; j++)
                    x[j] = decode_one<W>(sm.level, cur.cw, j, cur.scale) + x[j];
            }
        }
        // fetch the next step's inputs into the registers just consumed: the
        // loads are in flight while this step computes, with no copies
        Ln.advance(d_codes, d_gmeta, d_unit);
        if (pair + stride < npairs && s + ds < nsg)
            fetch<W, DT, DAR>(cur, kp, src, has_map, has_mean, in, Ln, Ain, sidx + ds, g, full_rows);
        encode_group<W, CORR, ONESTEP>(kp, sm, x, out, L, Aout, (uint32_t)(sidx * DQ_GROUPS + g), g,
                                       valid, Ex, key_value, key_perm, sigma);
        L = Ln;
        s += ds;
    }
}
