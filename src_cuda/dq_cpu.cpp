// dq_cpu.cpp -- the codec operations on the CPU, one super-group at a time,
// built from the same header functions as the GPU kernels.
#include "dq_api.h"

namespace {

struct RunView {
    uint8_t* codes;     // nsg * 32 * width
    uint8_t* gcodes;    // hierarchical: nsg * 16 uint8 group codes
    uint8_t* units;     // hierarchical: nsg BF16 units (little-endian)
    uint8_t* gscales;   // per-group BF16: nsg * 16 BF16 scales
};

RunView view_run(const DqParams* P, const uint8_t* base, int64_t nsg) {
    RunView v;
    v.codes = const_cast<uint8_t*>(base);
    uint8_t* meta = v.codes + nsg * (int64_t)dq_codes_bytes(P->width);
    if (P->hierarchical) {
        v.gcodes = meta; v.units = meta + nsg * DQ_GROUPS; v.gscales = nullptr;
    } else {
        v.gcodes = nullptr; v.units = nullptr; v.gscales = meta;
    }
    return v;
}

uint16_t load_u16(const uint8_t* p) { return (uint16_t)(p[0] | (p[1] << 8)); }
void store_u16(uint8_t* p, uint16_t v) { p[0] = (uint8_t)(v & 0xFF); p[1] = (uint8_t)(v >> 8); }

// Decoded scale of each of the 16 groups of super-group s.
void decode_scales(const DqParams* P, const RunView& v, int64_t s, float* scale) {
    if (P->hierarchical) {
        float unit = dq_bf16_to_f32(load_u16(v.units + 2 * s));
        for (int g = 0; g < DQ_GROUPS; g++) scale[g] = (float)v.gcodes[s * DQ_GROUPS + g] * unit;
    } else {
        for (int g = 0; g < DQ_GROUPS; g++)
            scale[g] = dq_bf16_to_f32(load_u16(v.gscales + 2 * (s * DQ_GROUPS + g)));
    }
}

void decode_sg(const DqParams* P, const RunView& v, int64_t s, float* out) {
    float scale[DQ_GROUPS];
    decode_scales(P, v, s, scale);
    const int gbytes = 2 * P->width;
    const uint8_t* codes = v.codes + s * (int64_t)dq_codes_bytes(P->width);
    for (int g = 0; g < DQ_GROUPS; g++)
        for (int j = 0; j < DQ_GROUP; j++)
            out[g * DQ_GROUP + j] =
                dq_dequantize(P, dq_unpack_code(codes + g * gbytes, P->width, j), scale[g]);
}

void encode_sg(const DqParams* P, const float* x, int64_t s, int64_t sg_index,
               uint32_t event, const RunView& v) {
    // x: the 256 local values of stream super-group sg_index (run-relative s)
    float gmax[DQ_GROUPS], smax = 0.0f;
    for (int g = 0; g < DQ_GROUPS; g++) {
        float m = 0.0f;
        for (int j = 0; j < DQ_GROUP; j++) {
            float a = fabsf(x[g * DQ_GROUP + j]);
            m = a > m ? a : m;
        }
        gmax[g] = m;
        smax = m > smax ? m : smax;
    }
    // Scale that each group's values are normalised by.
    float norm_scale[DQ_GROUPS];
    if (P->hierarchical) {
        uint16_t unit_bits = dq_unit_bf16(smax);
        store_u16(v.units + 2 * s, unit_bits);
        float unit = dq_bf16_to_f32(unit_bits);
        for (int g = 0; g < DQ_GROUPS; g++) {
            uint32_t code;
            if (P->scale_rule == 1) {
                uint32_t u = dq_event_uniform(P->key_value ^ DQ_HYBRID_KEY,
                                              (uint32_t)(sg_index * DQ_GROUPS + g), event);
                code = dq_scale_code_hybrid(gmax[g], unit, u, &norm_scale[g]);
            } else {
                code = dq_scale_code(gmax[g], unit);
                norm_scale[g] = (float)code * unit;   // the decoded scale (spec 2.7)
            }
            v.gcodes[s * DQ_GROUPS + g] = (uint8_t)code;
        }
    } else {
        for (int g = 0; g < DQ_GROUPS; g++) {
            uint16_t b = gmax[g] > 0.0f ? dq_f32_to_bf16_up(gmax[g]) : (uint16_t)0;
            store_u16(v.gscales + 2 * (s * DQ_GROUPS + g), b);
            norm_scale[g] = dq_bf16_to_f32(b);
        }
    }
    const int w = P->width, gbytes = 2 * w;
    uint8_t* codes = v.codes + s * (int64_t)dq_codes_bytes(w);
    memset(codes, 0, (size_t)dq_codes_bytes(w));
    // the super-group's permutation, once for its 16 groups
    const uint32_t sigma = dq_sg_sigma(P, (uint32_t)(sg_index * DQ_GROUPS), event);
    for (int g = 0; g < DQ_GROUPS; g++) {
        uint8_t* gc = codes + g * gbytes;
        if (!(norm_scale[g] > 0.0f)) {          // all-zero group: the zero code
            for (int j = 0; j < DQ_GROUP; j++)
                gc[(j * w) >> 3] |= (uint8_t)(P->radius << ((j * w) & 7));
            continue;
        }
        DqNorm nm = dq_norm_for_scale(norm_scale[g]);
        DqGroupRng rng = dq_group_rng(P, (uint32_t)(sg_index * DQ_GROUPS + g), event, sigma);
        for (int j = 0; j < DQ_GROUP; j++) {
            uint32_t code = dq_encode_lane(P, x[g * DQ_GROUP + j], nm, rng, (uint32_t)j);
            gc[(j * w) >> 3] |= (uint8_t)(code << ((j * w) & 7));
        }
    }
}

void load_local(const DqSource* S, int64_t stream_sg, float* out) {
    int64_t row = dq_source_row(S, stream_sg);
    for (int i = 0; i < DQ_SUPER; i++) out[i] = dq_source_value(S, row, i);
}

// The final rounding of a result element (the GPU's store_final): (v + ms) /
// divisor (skipped for 1), stored at out[k] as float32 or BF16 (nearest even).
void store_final(float v, float ms, float divisor, void* out, int dtype, int64_t k) {
    v = v + ms;
    if (divisor != 1.0f) v = v / divisor;
    if (dtype) ((uint16_t*)out)[k] = dq_f32_to_bf16_rne(v);
    else ((float*)out)[k] = v;
}

}  // namespace

extern "C" {

int64_t dq_cpu_stats(const DqSource* S, int64_t nsg, int centre, float* mean, float* norm2,
                     float* tail) {
    int64_t nonfinite = 0;
    float total_absmax = 0.0f;
    float v[DQ_SUPER], scaled[DQ_SUPER];
    double buf[DQ_SUPER];
    for (int64_t s = 0; s < nsg; s++) {
        float absmax = 0.0f;
        for (int i = 0; i < DQ_SUPER; i++) {
            v[i] = dq_source_value(S, s, i);
            scaled[i] = v[i] * DQ_MEAN_SCALE;
            nonfinite += !isfinite(v[i]);
            float a = fabsf(v[i]);
            absmax = a > absmax ? a : absmax;
        }
        total_absmax = absmax > total_absmax ? absmax : total_absmax;
        float mu = 0.0f;
        if (centre) mu = dq_mean_from_tree(dq_tree_sum256f(scaled), absmax);
        for (int i = 0; i < DQ_SUPER; i++) {
            double c = (double)(v[i] - mu);
            buf[i] = c * c;
        }
        if (mean) mean[s] = mu;
        norm2[s] = dq_norm2_to_f32(dq_tree_sum256(buf));
    }
    if (tail) {
        tail[0] = nonfinite ? 1.0f : 0.0f;
        tail[1] = total_absmax;
    }
    return nonfinite;
}

void dq_cpu_compress(const DqParams* P, const DqSource* local, int64_t nsg, int64_t sg_base,
                     uint32_t event, uint8_t* out) {
    RunView v = view_run(P, out, nsg);
    float x[DQ_SUPER];
    for (int64_t s = 0; s < nsg; s++) {
        load_local(local, sg_base + s, x);
        encode_sg(P, x, s, sg_base + s, event, v);
    }
}

void dq_cpu_decompress(const DqParams* P, const uint8_t* in, int64_t nsg,
                       float* out, int accumulate) {
    RunView v = view_run(P, in, nsg);
    float tmp[DQ_SUPER];
    for (int64_t s = 0; s < nsg; s++) {
        float* o = out + s * DQ_SUPER;
        if (accumulate) {
            decode_sg(P, v, s, tmp);
            for (int i = 0; i < DQ_SUPER; i++) o[i] = o[i] + tmp[i];
        } else {
            decode_sg(P, v, s, o);
        }
    }
}

void dq_cpu_dar(const DqParams* P, const uint8_t* in, const DqSource* local, int64_t nsg,
                int64_t sg_base, uint32_t event, uint8_t* out) {
    RunView vin = view_run(P, in, nsg), vout = view_run(P, out, nsg);
    float tmp[DQ_SUPER], x[DQ_SUPER];
    for (int64_t s = 0; s < nsg; s++) {
        decode_sg(P, vin, s, tmp);
        load_local(local, sg_base + s, x);
        for (int i = 0; i < DQ_SUPER; i++) tmp[i] = tmp[i] + x[i];
        encode_sg(P, tmp, s, sg_base + s, event, vout);
    }
}

void dq_cpu_finish(const float* stream, const int64_t* stream_of_sg, const float* mean_sum,
                   int64_t nsg, float divisor, void* out, int dtype, int64_t length) {
    for (int64_t g = 0; g < nsg; g++) {
        int64_t s = stream_of_sg[g];
        if (s >= 0 && !stream) continue;     // written by a decompress_out already
        for (int i = 0; i < DQ_SUPER; i++) {
            int64_t k = g * DQ_SUPER + i;
            if (k >= length) return;
            store_final(s >= 0 ? stream[s * DQ_SUPER + i] : 0.0f, mean_sum[g], divisor, out,
                        dtype, k);
        }
    }
}

void dq_cpu_decompress_out(const DqParams* P, const uint8_t* in, int64_t nsg, int64_t sg_base,
                           const int64_t* order, const float* mean_sum, float divisor, void* out,
                           int dtype, int64_t length) {
    RunView v = view_run(P, in, nsg);
    float tmp[DQ_SUPER];
    for (int64_t s = 0; s < nsg; s++) {
        const int64_t g = order[sg_base + s];
        decode_sg(P, v, s, tmp);
        for (int i = 0; i < DQ_SUPER; i++) {
            const int64_t k = g * DQ_SUPER + i;
            if (k >= length) break;
            store_final(tmp[i], mean_sum[g], divisor, out, dtype, k);
        }
    }
}

// ---------------------------------------------------------------- 16-bit class
void dq_cpu_bf16_encode(const uint8_t* in, const DqSource* local, int64_t nsg, int64_t sg_base,
                        uint8_t* out) {
    float x[DQ_SUPER];
    for (int64_t s = 0; s < nsg; s++) {
        load_local(local, sg_base + s, x);
        const int64_t e0 = s * DQ_SUPER;
        for (int i = 0; i < DQ_SUPER; i++) {
            // (no "0 +" for compress: -0.0 must stay -0.0, as on the GPU)
            const float v = in ? dq_bf16_to_f32(load_u16(in + 2 * (e0 + i))) + x[i] : x[i];
            store_u16(out + 2 * (e0 + i), dq_f32_to_bf16_rne(v));
        }
    }
}

void dq_cpu_bf16_decompress(const uint8_t* in, int64_t n, float* out, int accumulate) {
    for (int64_t e = 0; e < n; e++) {
        const float v = dq_bf16_to_f32(load_u16(in + 2 * e));
        out[e] = accumulate ? out[e] + v : v;
    }
}

void dq_cpu_bf16_decompress_out(const uint8_t* in, int64_t nsg, int64_t sg_base,
                                const int64_t* order, const float* mean_sum, float divisor,
                                void* out, int dtype, int64_t length) {
    for (int64_t s = 0; s < nsg; s++) {
        const int64_t g = order[sg_base + s];
        for (int i = 0; i < DQ_SUPER; i++) {
            const int64_t k = g * DQ_SUPER + i;
            if (k >= length) break;
            store_final(dq_bf16_to_f32(load_u16(in + 2 * (s * DQ_SUPER + i))), mean_sum[g],
                        divisor, out, dtype, k);
        }
    }
}

}  // extern "C"
