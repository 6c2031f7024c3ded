// dq_k_decode.cuh -- the decoders: decompress(-accumulate), decode into the caller's layout.
// A part of dq_kernels.cu (one translation unit: the parts share its anonymous
// namespace and inline into each other); included there, in order, never alone.

// The final rounding of every result: (v + ms) / divisor (skipped for 1),
// stored at out[k0 ..) as float32 or BF16 (nearest even), N values, those at
// or beyond `length` dropped.  Shared by k_finish and k_decompress_out.
template <int N>
__device__ __forceinline__ void store_final(float (&v)[N], float ms, float divisor, void* out,
                                            int dtype, int64_t k0, int64_t length) {
#pragma unroll
    for (int j = 0; j < N; j++) {
        v[j] = v[j] + ms;
        if (divisor != 1.0f) v[j] = v[j] / divisor;
    }
    const bool full = k0 + N <= length;
    if (dtype) {
        uint16_t* o = static_cast<uint16_t*>(out) + k0;
        if (full && aligned(o, 2 * N)) {
            uint32_t w[N / 2];
#pragma unroll
            for (int i = 0; i < N / 2; i++)
                w[i] = (uint32_t)dq_f32_to_bf16_rne(v[2 * i]) |
                       ((uint32_t)dq_f32_to_bf16_rne(v[2 * i + 1]) << 16);
            if constexpr (N == 8) *reinterpret_cast<uint4*>(o) = make_uint4(w[0], w[1], w[2], w[3]);
            else *reinterpret_cast<uint2*>(o) = make_uint2(w[0], w[1]);
        } else {
#pragma unroll
            for (int j = 0; j < N; j++)
                if (k0 + j < length) o[j] = dq_f32_to_bf16_rne(v[j]);
        }
    } else {
        float* o = static_cast<float*>(out) + k0;
        if (full && aligned(o, 16)) {
#pragma unroll
            for (int q = 0; q < N / 4; q++)
                reinterpret_cast<float4*>(o)[q] = make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
        } else {
#pragma unroll
            for (int j = 0; j < N; j++)
                if (k0 + j < length) o[j] = v[j];
        }
    }
}

// The 4 decoded values of decompress chunk c (entries 4 (c & 63) .. + 3 of
// stream super-group c >> 6 of a run of nsg): level of the code times the
// group's scale.  meta = in + nsg * 32 W (the run's scales).
template <int W>
__device__ __forceinline__ void decode_chunk(const SmemTables<W>& sm, const KParams& kp,
                                             const uint8_t* in, const uint8_t* meta, int64_t nsg,
                                             int64_t c, bool codes_aligned, bool units_aligned,
                                             float (&v)[4]) {
    const int64_t s = c >> 6;                 // 64 chunks per super-group
    const int64_t grp = c >> 2;               // global group index s * 16 + g
    const uint8_t* cp = in + c * (W / 2);
    uint32_t bits;
    if (W == 2) bits = cp[0];
    else if (W == 4) bits = codes_aligned ? *reinterpret_cast<const uint16_t*>(cp)
                                          : (uint32_t)(cp[0] | (cp[1] << 8));
    else bits = codes_aligned ? *reinterpret_cast<const uint32_t*>(cp)
                              : (uint32_t)cp[0] | ((uint32_t)cp[1] << 8) |
                                ((uint32_t)cp[2] << 16) | ((uint32_t)cp[3] << 24);
    float scale;
    if (kp.hierarchical) {
        const uint8_t* up = meta + nsg * DQ_GROUPS + 2 * s;
        const uint16_t ub = units_aligned ? *reinterpret_cast<const uint16_t*>(up)
                                          : (uint16_t)(up[0] | (up[1] << 8));
        scale = (float)meta[grp] * dq_bf16_to_f32(ub);
    } else {
        scale = dq_bf16_to_f32(ld_u16(meta + 2 * grp));
    }
#pragma unroll
    for (int j = 0; j < 4; j++)
        v[j] = sm.level[(bits >> (j * W)) & ((1u << W) - 1u)] * scale;
}

// Decompress: each thread step produces 4 consecutive outputs (one float4), so
// the warp reads 32 consecutive code pieces and writes 512 consecutive bytes.
template <int W>
__global__ void __launch_bounds__(kThreads)
k_decompress(const __grid_constant__ KParams kp, const uint8_t* in, int64_t nsg, float* out,
             int accumulate, const int64_t* piece) {
    if (piece) {     // the fixed layout: out is a stream buffer, its row s is stream super-group s
        nsg = __ldg(piece + 1);
        in += __ldg(piece + 2);
        out += __ldg(piece) * DQ_SUPER;
    }
    __shared__ SmemTables<W> sm;
    load_tables<W>(sm, kp, false, true);
    const int64_t nchunks = nsg * (DQ_SUPER / 4);
    const uint8_t* meta = in + nsg * (32 * W);
    // codes of a chunk: W/2 bytes at in + c * (W/2); aligned when in is
    const bool codes_aligned = aligned(in, W / 2 > 1 ? W / 2 : 1);
    const bool out_aligned = aligned(out, 16);
    const bool units_aligned = aligned(meta + nsg * DQ_GROUPS, 2);
    for (int64_t c = (int64_t)blockIdx.x * kThreads + threadIdx.x; c < nchunks;
         c += (int64_t)gridDim.x * kThreads) {
        float v[4];
        decode_chunk<W>(sm, kp, in, meta, nsg, c, codes_aligned, units_aligned, v);
        float* o = out + 4 * c;
        if (out_aligned) {
            float4* o4 = reinterpret_cast<float4*>(o);
            if (accumulate) {
                float4 a = *o4;
                a.x = a.x + v[0]; a.y = a.y + v[1]; a.z = a.z + v[2]; a.w = a.w + v[3];
                *o4 = a;
            } else {
                *o4 = make_float4(v[0], v[1], v[2], v[3]);
            }
        } else {
#pragma unroll
            for (int j = 0; j < 4; j++) o[j] = accumulate ? o[j] + v[j] : v[j];
        }
    }
}

// Decompress straight into the caller's layout (the decode and the final
// scatter of k_finish in one pass): stream super-group sg_base + s is input row
// g = order[sg_base + s]; out[g * 256 + i] = store((v + mean_sum[g]) / divisor),
// v the value k_decompress writes, so the bits equal decompress + finish.
template <int W>
__global__ void __launch_bounds__(kThreads)
k_decompress_out(const __grid_constant__ KParams kp, const uint8_t* in, int64_t nsg,
                 int64_t sg_base, const int64_t* order, const float* mean_sum, float divisor,
                 void* out, int dtype, int64_t length, const int64_t* piece) {
    if (piece) {     // the fixed layout
        sg_base = __ldg(piece);
        nsg = __ldg(piece + 1);
        in += __ldg(piece + 2);
    }
    __shared__ SmemTables<W> sm;
    load_tables<W>(sm, kp, false, true);
    const int64_t nchunks = nsg * (DQ_SUPER / 4);
    const uint8_t* meta = in + nsg * (32 * W);
    const bool codes_aligned = aligned(in, W / 2 > 1 ? W / 2 : 1);
    const bool units_aligned = aligned(meta + nsg * DQ_GROUPS, 2);
    for (int64_t c = (int64_t)blockIdx.x * kThreads + threadIdx.x; c < nchunks;
         c += (int64_t)gridDim.x * kThreads) {
        const int64_t g = __ldg(order + sg_base + (c >> 6));
        const int64_t k0 = g * DQ_SUPER + (c & 63) * 4;
        if (k0 >= length) continue;
        float v[4];
        decode_chunk<W>(sm, kp, in, meta, nsg, c, codes_aligned, units_aligned, v);
        store_final<4>(v, __ldg(mean_sum + g), divisor, out, dtype, k0, length);
    }
}
