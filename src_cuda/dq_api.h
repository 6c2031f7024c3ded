// dq_api.h -- C API of the codec operations, CPU (dq_cpu_*) and GPU (dq_gpu_*).
//
// A "run" is nsg consecutive stream super-groups of one width, laid out on the
// wire as structure-of-arrays so the GPU reads and writes coalesced:
//   hierarchical:   codes[nsg * 32 * width] | group codes[nsg * 16] | units[nsg] (BF16)
//   per-group BF16: codes[nsg * 32 * width] | group scales[nsg * 16] (BF16)
// sg_base is the stream index of the run's first super-group: it keys the
// generator (every rank draws the same uniforms for a coordinate) and indexes
// the DqSource the local values come from.
#pragma once
#include <stdint.h>
#include "dq_codec.h"

#ifdef __cplusplus
extern "C" {
#endif

// Statistics of the nsg input super-groups of S (S->sg_map and S->mean must be
// NULL): per super-group mean (0 when centre == 0; `mean` may be NULL then) and
// squared norm of the centred values, rounded up to float32.  Returns the number
// of non-finite inputs.  `tail` (may be NULL) receives the per-call pair that
// rides the statistics reduction: tail[0] = 1 if any input is non-finite else 0,
// tail[1] = max |x| over the input (NaN ignored).
int64_t dq_cpu_stats(const DqSource* S, int64_t nsg, int centre, float* mean, float* norm2,
                     float* tail);

// out = compress(local values of stream super-groups sg_base .. sg_base + nsg)
void dq_cpu_compress(const DqParams* P, const DqSource* local, int64_t nsg, int64_t sg_base,
                     uint32_t event, uint8_t* out);
// out[s * 256 + i] (+)= decode(in)
void dq_cpu_decompress(const DqParams* P, const uint8_t* in, int64_t nsg,
                       float* out, int accumulate);
// out = compress(decode(in) + local), the sum kept in float32 registers only
void dq_cpu_dar(const DqParams* P, const uint8_t* in, const DqSource* local, int64_t nsg,
                int64_t sg_base, uint32_t event, uint8_t* out);

// Final write into the caller's layout: for input super-group g,
// v = (stream_of_sg[g] >= 0 ? stream[stream_of_sg[g] * 256 + i] : 0) + mean_sum[g],
// then v / divisor (skipped when divisor == 1), stored as float32 or BF16 (RNE)
// for the first `length` elements only.
// stream NULL: only the rows absent from the stream (stream_of_sg[g] < 0) are
// written; the others are left as they are (filled by the decompress_out calls).
void dq_cpu_finish(const float* stream, const int64_t* stream_of_sg, const float* mean_sum,
                   int64_t nsg, float divisor, void* out, int dtype, int64_t length);
// decompress and finish in one pass for the nsg stream super-groups from
// sg_base: stream super-group s goes to input row order[s] of out, as
// dq_cpu_finish would write it from the decompressed values (same bits).
void dq_cpu_decompress_out(const DqParams* P, const uint8_t* in, int64_t nsg, int64_t sg_base,
                           const int64_t* order, const float* mean_sum, float divisor, void* out,
                           int dtype, int64_t length);

// The 16-bit class (raw BF16 records of 256 little-endian values per
// super-group; the GPU's dq_gpu_bf16_* on a source shifted to sg_base):
// encode   out[e] = bf16_rne(local(e))                  (in NULL: compress)
//          out[e] = bf16_rne(float(in[e]) + local(e))   (dar)
//          local(e) = element e % 256 of stream super-group sg_base + e / 256
// decompress      out[e] (+)= float(in[e]), e < n
// decompress_out  as dq_cpu_decompress_out, for raw records
void dq_cpu_bf16_encode(const uint8_t* in, const DqSource* local, int64_t nsg, int64_t sg_base,
                        uint8_t* out);
void dq_cpu_bf16_decompress(const uint8_t* in, int64_t n, float* out, int accumulate);
void dq_cpu_bf16_decompress_out(const uint8_t* in, int64_t nsg, int64_t sg_base,
                                const int64_t* order, const float* mean_sum, float divisor,
                                void* out, int dtype, int64_t length);

#ifdef __cplusplus
}
#endif
