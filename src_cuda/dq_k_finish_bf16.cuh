// dq_k_finish_bf16.cuh -- the final scatter, the 16-bit class (raw BF16 records) and the BF16 / exact baselines.
// A part of dq_kernels.cu (one translation unit: the parts share its anonymous
// namespace and inline into each other); included there, in order, never alone.

// Final scatter: 8 entries per thread step (one input super-group each).
__global__ void __launch_bounds__(kThreads)
k_finish(const float* stream, const int64_t* stream_of_sg, const float* mean_sum, int64_t nsg,
         float divisor, void* out, int dtype, int64_t length, const double* refuse, float limit) {
    const int64_t nchunks = nsg * (DQ_SUPER / 8);
    // the fixed layout's refusal, read from the plan header on the device
    // (non-finite input, sums that could overflow, a layout overflow): every
    // rank holds the same header, so every rank writes NaN everywhere
    const bool nan_all = refuse && (!(refuse[0] <= 0.0) || !(refuse[1] <= (double)limit) ||
                                    refuse[2] == 0.0 || refuse[11] != 0.0 || refuse[12] != 0.0);
    for (int64_t c = (int64_t)blockIdx.x * kThreads + threadIdx.x; c < nchunks;
         c += (int64_t)gridDim.x * kThreads) {
        const int64_t g = c >> 5;
        const int i0 = (int)(c & 31) * 8;
        const int64_t k0 = g * DQ_SUPER + i0;
        if (k0 >= length) continue;
        const int64_t s = __ldg(stream_of_sg + g);
        if (s >= 0 && !stream && !nan_all) continue;     // written by decompress_out already
        const float ms = __ldg(mean_sum + g);
        float v[8];
        if (nan_all) {
#pragma unroll
            for (int j = 0; j < 8; j++) v[j] = __int_as_float(0x7fc00000);
        } else if (s >= 0) {
            const float* p = stream + s * DQ_SUPER + i0;
            if (aligned(p, 16)) {
                ldg_f32x8(p, v);
            } else {
#pragma unroll
                for (int j = 0; j < 8; j++) v[j] = __ldg(p + j);
            }
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++) v[j] = 0.0f;
        }
        store_final<8>(v, ms, divisor, out, dtype, k0, length);
    }
}

// The 16-bit class straight into the caller's layout (k_plain_decode of raw
// BF16 records and the scatter of k_finish in one pass): 8 entries per thread
// step; stream super-group sg_base + s (records of 256 BF16 values from `in`)
// is input row g = order[sg_base + s]; out[g * 256 + i] =
// store((float(in[s * 256 + i]) + mean_sum[g]) / divisor), the bits of
// bf16_decompress + finish.
__global__ void __launch_bounds__(kThreads)
k_bf16_decompress_out(const uint16_t* in, int64_t nsg, int64_t sg_base, const int64_t* order,
                      const float* mean_sum, float divisor, void* out, int dtype,
                      int64_t length, const int64_t* piece) {
    if (piece) {     // the fixed layout
        sg_base = __ldg(piece);
        nsg = __ldg(piece + 1);
        in = reinterpret_cast<const uint16_t*>(reinterpret_cast<const uint8_t*>(in) + __ldg(piece + 2));
    }
    const int64_t nchunks = nsg * (DQ_SUPER / 8);
    const bool in_aligned = aligned(in, 16);
    for (int64_t c = (int64_t)blockIdx.x * kThreads + threadIdx.x; c < nchunks;
         c += (int64_t)gridDim.x * kThreads) {
        const int64_t g = __ldg(order + sg_base + (c >> 5));
        const int64_t k0 = g * DQ_SUPER + (c & 31) * 8;
        if (k0 >= length) continue;
        const uint16_t* p = in + c * 8;
        float v[8];
        if (in_aligned) {
            bf16x8_to_f32(__ldg(reinterpret_cast<const uint4*>(p)), v);
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++) v[j] = dq_bf16_to_f32(__ldg(p + j));
        }
        store_final<8>(v, __ldg(mean_sum + g), divisor, out, dtype, k0, length);
    }
}

// The keys of a call replayed as a CUDA graph (DqParams.key_ptr): written on
// the replay's stream before it, from the launch's arguments (no host buffer
// whose reuse would race the copy).
__global__ void k_set_keys(uint32_t* dst, uint32_t key_value, uint32_t key_perm) {
    dst[0] = key_value;
    dst[1] = key_perm;
}

// ---------------------------------------------------------------- baselines
// OP 0: bf16 compress, 1: bf16 dar, 2: exact compress, 3: exact dar.
// Writes stream elements [0, n), n <= nsg * 256 (the last super-group may be partial).
template <int OP>
__global__ void __launch_bounds__(kThreads)
k_plain_encode(const DqSource src0, int64_t nsg, int64_t n, const void* in, void* out,
               const int64_t* piece) {
    DqSource src = src0;
    if (piece) {     // the fixed layout: stream super-groups from piece[0], bytes at piece[2]
        const int64_t s0 = __ldg(piece);
        if (src.sg_map) src.sg_map += s0; else src.sg_offset -= s0;
        nsg = __ldg(piece + 1);
        n = nsg * DQ_SUPER;
        in = static_cast<const uint8_t*>(in) + __ldg(piece + 2);
        out = static_cast<uint8_t*>(out) + __ldg(piece + 2);
    }
    const int64_t nchunks = (n + 7) >> 3;
    for (int64_t c = (int64_t)blockIdx.x * kThreads + threadIdx.x; c < nchunks;
         c += (int64_t)gridDim.x * kThreads) {
        const int64_t s = c >> 5;
        const int i0 = (int)(c & 31) * 8;
        float v[8];
        load_source<8>(src, source_row(src, s), i0, v);
        const int64_t e0 = s * DQ_SUPER + i0;
        const bool full = e0 + 8 <= n;
        if (OP == 1) {
            const uint16_t* p = static_cast<const uint16_t*>(in) + e0;
            if (full && aligned(p, 16)) {
                uint4 q = *reinterpret_cast<const uint4*>(p);
                uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    v[2 * i] = __uint_as_float(w[i] << 16) + v[2 * i];
                    v[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u) + v[2 * i + 1];
                }
            } else {
#pragma unroll
                for (int j = 0; j < 8; j++)
                    if (e0 + j < n) v[j] = dq_bf16_to_f32(p[j]) + v[j];
            }
        } else if (OP == 3) {
            const float* p = static_cast<const float*>(in) + e0;
            if (full && aligned(p, 16)) {
                float4 a = reinterpret_cast<const float4*>(p)[0];
                float4 b = reinterpret_cast<const float4*>(p)[1];
                v[0] = a.x + v[0]; v[1] = a.y + v[1]; v[2] = a.z + v[2]; v[3] = a.w + v[3];
                v[4] = b.x + v[4]; v[5] = b.y + v[5]; v[6] = b.z + v[6]; v[7] = b.w + v[7];
            } else {
#pragma unroll
                for (int j = 0; j < 8; j++)
                    if (e0 + j < n) v[j] = p[j] + v[j];
            }
        }
        if (OP <= 1) {
            uint16_t* o = static_cast<uint16_t*>(out) + e0;
            uint16_t h[8];
#pragma unroll
            for (int j = 0; j < 8; j++) h[j] = dq_f32_to_bf16_rne(v[j]);
            if (full && aligned(o, 16)) {
                *reinterpret_cast<uint4*>(o) = make_uint4(
                    h[0] | ((uint32_t)h[1] << 16), h[2] | ((uint32_t)h[3] << 16),
                    h[4] | ((uint32_t)h[5] << 16), h[6] | ((uint32_t)h[7] << 16));
            } else {
#pragma unroll
                for (int j = 0; j < 8; j++)
                    if (e0 + j < n) o[j] = h[j];
            }
        } else {
            float* o = static_cast<float*>(out) + e0;
            if (full && aligned(o, 16)) {
                reinterpret_cast<float4*>(o)[0] = make_float4(v[0], v[1], v[2], v[3]);
                reinterpret_cast<float4*>(o)[1] = make_float4(v[4], v[5], v[6], v[7]);
            } else {
#pragma unroll
                for (int j = 0; j < 8; j++)
                    if (e0 + j < n) o[j] = v[j];
            }
        }
    }
}

// out[e] (+)= float(in[e]) for n elements; BF16 (IS_BF16) or float32 input.
template <bool IS_BF16>
__global__ void __launch_bounds__(kThreads)
k_plain_decode(const void* in, int64_t n, float* out, int accumulate, const int64_t* piece) {
    if (piece) {     // the fixed layout: out is a stream buffer, its row s is stream super-group s
        n = __ldg(piece + 1) * DQ_SUPER;
        in = static_cast<const uint8_t*>(in) + __ldg(piece + 2);
        out += __ldg(piece) * DQ_SUPER;
    }
    const int64_t nchunks = (n + 7) >> 3;
    for (int64_t c = (int64_t)blockIdx.x * kThreads + threadIdx.x; c < nchunks;
         c += (int64_t)gridDim.x * kThreads) {
        const int64_t e0 = c * 8;
        float v[8];
        const bool full = e0 + 8 <= n;
        if (IS_BF16) {
            const uint16_t* p = static_cast<const uint16_t*>(in) + e0;
            if (full && aligned(p, 16)) {
                bf16x8_to_f32(__ldg(reinterpret_cast<const uint4*>(p)), v);
            } else {
#pragma unroll
                for (int j = 0; j < 8; j++) v[j] = (e0 + j < n) ? dq_bf16_to_f32(p[j]) : 0.0f;
            }
        } else {
            const float* p = static_cast<const float*>(in) + e0;
            if (full && aligned(p, 16)) {
                ldg_f32x8(p, v);
            } else {
#pragma unroll
                for (int j = 0; j < 8; j++) v[j] = (e0 + j < n) ? p[j] : 0.0f;
            }
        }
        float* o = out + e0;
        if (full && aligned(o, 16)) {
            float4* o4 = reinterpret_cast<float4*>(o);
            if (accumulate) {
                float4 a = o4[0], b = o4[1];
                a.x = a.x + v[0]; a.y = a.y + v[1]; a.z = a.z + v[2]; a.w = a.w + v[3];
                b.x = b.x + v[4]; b.y = b.y + v[5]; b.z = b.z + v[6]; b.w = b.w + v[7];
                o4[0] = a; o4[1] = b;
            } else {
                o4[0] = make_float4(v[0], v[1], v[2], v[3]);
                o4[1] = make_float4(v[4], v[5], v[6], v[7]);
            }
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++)
                if (e0 + j < n) o[j] = accumulate ? o[j] + v[j] : v[j];
        }
    }
}
