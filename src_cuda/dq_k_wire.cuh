// dq_k_wire.cuh -- where a lane's group lives in a run's wire buffer; reading and decoding one group.
// A part of dq_kernels.cu (one translation unit: the parts share its anonymous
// namespace and inline into each other); included there, in order, never alone.

// ---------------------------------------------------------------- one group
// Where one lane's group lives in a run's wire buffer (a run of nsg
// super-groups), as byte offsets (the same for the incoming and the outgoing
// buffer of dar): its codes, its group code (hierarchical) or BF16 scale, and
// its super-group's BF16 unit.  The kernels advance them by a fixed number of
// super-groups per step (strength-reduced 64-bit address math).
template <int W>
struct WireLoc {
    int64_t codes;   // s * 32W + g * 2W
    int64_t gmeta;   // meta + s * 16 + g (hierarchical) or meta + 2 * (s * 16 + g)
    int64_t unit;    // meta + nsg * 16 + 2 s (hierarchical), meta = nsg * 32W
    __device__ __forceinline__ void init(int64_t nsg, int64_t s, int g, int hier) {
        const int64_t meta = nsg * (32 * W);
        codes = s * (32 * W) + g * (2 * W);
        gmeta = hier ? meta + s * DQ_GROUPS + g : meta + 2 * (s * DQ_GROUPS + g);
        unit = meta + nsg * DQ_GROUPS + 2 * s;
    }
    __device__ __forceinline__ void advance(int64_t d_codes, int64_t d_gmeta, int64_t d_unit) {
        codes += d_codes; gmeta += d_gmeta; unit += d_unit;
    }
};
// Alignment facts of a wire buffer, the same for every group (loop-invariant).
struct WireAlign {
    bool codes;   // codes of a group are 2W-aligned
    bool meta2;   // per-group BF16 scales are 2-aligned
    bool unit;    // units are 2-aligned
};
template <int W>
__device__ __forceinline__ WireAlign wire_align(const uint8_t* base, int64_t nsg) {
    return WireAlign{aligned(base, 2 * W), aligned(base, 2),
                     aligned(base + nsg * (32 * W + DQ_GROUPS), 2)};
}
__device__ __forceinline__ uint16_t ld_u16a(const uint8_t* p, bool al) {
    if (al) return *reinterpret_cast<const uint16_t*>(p);
    return (uint16_t)(p[0] | (p[1] << 8));
}
__device__ __forceinline__ void st_u16a(uint8_t* p, uint16_t v, bool al) {
    if (al) { *reinterpret_cast<uint16_t*>(p) = v; return; }
    p[0] = (uint8_t)(v & 0xFF); p[1] = (uint8_t)(v >> 8);
}
// Read one group: its packed codes and its decoded scale.
template <int W>
__device__ __forceinline__ void read_group(const uint8_t* in, const WireLoc<W>& L, const WireAlign& A,
                                           int hierarchical, uint32_t (&cw)[W / 2], float& scale) {
    const uint8_t* pc = in + L.codes;
    if (A.codes) {
        if (W == 2) { cw[0] = *reinterpret_cast<const uint32_t*>(pc); }
        else if (W == 4) { const uint2 v = *reinterpret_cast<const uint2*>(pc); cw[0] = v.x; cw[W / 2 > 1 ? 1 : 0] = v.y; }
        else { const uint4 v = *reinterpret_cast<const uint4*>(pc);
               cw[0] = v.x; cw[W / 2 > 1 ? 1 : 0] = v.y; cw[W / 2 > 2 ? 2 : 0] = v.z; cw[W / 2 > 3 ? 3 : 0] = v.w; }
    } else {
#pragma unroll
        for (int i = 0; i < W / 2; i++)
            cw[i] = (uint32_t)pc[4 * i] | ((uint32_t)pc[4 * i + 1] << 8) |
                    ((uint32_t)pc[4 * i + 2] << 16) | ((uint32_t)pc[4 * i + 3] << 24);
    }
    if (hierarchical) {
        const float unit = dq_bf16_to_f32(ld_u16a(in + L.unit, A.unit));
        scale = (float)in[L.gmeta] * unit;
    } else {
        scale = dq_bf16_to_f32(ld_u16a(in + L.gmeta, A.meta2));
    }
}
template <int W>
__device__ __forceinline__ float decode_one(const float* level, const uint32_t (&cw)[W / 2],
                                            int j, float scale) {
    const uint32_t code = (cw[(j * W) >> 5] >> ((j * W) & 31)) & ((1u << W) - 1u);
    return level[code] * scale;
}
