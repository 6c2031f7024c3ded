// mx_api.h -- C API of the MX baseline kernels (src_cuda/mx_kernels.cu): the
// OCP MX element formats of dynamiq_mpi/codecs/mxfp.py, fused like DynamiQ's
// (one pass per hop: read the received codes and the local values, add in
// float32, re-cast, pack).  Bit for bit the NumPy path of mxfp.py: the same
// IEEE operations (exact power-of-two scaling rounded to nearest even where
// the result is subnormal, as C's ldexpf; round to nearest even to the
// element grid; saturation at the largest normal).
//
// Conventions as dq_gpu_api.h: device pointers, `stream` a cudaStream_t as an
// integer, nothing synchronises, a cudaError_t code is returned.  Blocks are 32
// elements; wire bytes are the packed codes, bits * 4 bytes per block, low bits
// first, and may start at any byte offset.
#pragma once
#include <stdint.h>
#include "dq_codec.h"

#ifdef __cplusplus
extern "C" {
#endif

// An element format: `bits` in all (sign, exponent, `mbits` mantissa bits),
// exponent bias, largest normal (the saturation value).
typedef struct DqMxFormat {
    int32_t bits, mbits, bias;
    float max_normal;
} DqMxFormat;

// Shared-exponent bytes of the nblocks blocks of S (element b * 32 + i is the
// source value of row (b * 32 + i) / 256; S->sg_map, S->mean must be NULL):
// 0 for an all-zero block, 255 when it holds NaN/Inf, else the float32
// exponent field of its largest |value| clipped to [1, 254]
// (= floor(log2 max) + 127).
int dq_gpu_mx_stats(const DqSource* S, int64_t nblocks, uint8_t* out, uintptr_t stream);

// Blocks [0, nblocks) of a tile.  Block b's shared exponent is
// X = reduced[b] == 0 ? 0 : reduced[b] - 127 + 1 + headroom - emax
// (emax = floor(log2(max_normal))).  Element j's
// local value is local(elem_base + j) (elem_base a multiple of 8).
// encode: out = pack(cast(local + decode(in))) (in == NULL: of local alone);
//         `in` and `out` may be the same buffer.
int dq_gpu_mx_encode(DqMxFormat f, const uint8_t* reduced, int32_t headroom,
                     const DqSource* local, int64_t elem_base, const uint8_t* in,
                     int64_t nblocks, uint8_t* out, uintptr_t stream);
// decode: out[j] = B + decode(in)[j], B = local(elem_base + j) when `local` is
// given, else out[j] when `accumulate`, else nothing (out = decode(in)).
int dq_gpu_mx_decode(DqMxFormat f, const uint8_t* reduced, int32_t headroom, const uint8_t* in,
                     int64_t nblocks, const DqSource* local, int64_t elem_base, float* out,
                     int accumulate, uintptr_t stream);

#ifdef __cplusplus
}
#endif
