// dq_gpu_api.h -- C API of the CUDA codec kernels (src_cuda/dq_kernels.cu).
//
// Every dq_gpu_* twin of a dq_cpu_* function of dq_api.h produces the same
// bytes and the same float32 values, bit for bit, for the same inputs (same
// header math, nvcc -fmad=false -ftz=false -prec-div=true -prec-sqrt=true).
//
// Conventions:
//  * array arguments are DEVICE pointers; DqParams and DqSource are HOST structs
//    (a DqSource holds device pointers).  The params are passed to the kernel by
//    value (__grid_constant__), so calls on different streams never share state;
//  * `stream` is a cudaStream_t as an integer (0: the legacy default stream);
//  * every function enqueues its work and returns a cudaError_t code (0 on
//    success, the launch error otherwise); nothing synchronises;
//  * wire buffers may start at any byte offset (runs are concatenated in one
//    message); vector accesses are used where the addresses allow.
#pragma once
#include <stdint.h>
#include "dq_api.h"

#ifdef __cplusplus
extern "C" {
#endif

// -------------------------------------------------------------- device/runtime
int dq_gpu_device_count(int* count);            // cudaGetDeviceCount (never crashes)
const char* dq_gpu_error_string(int code);      // cudaGetErrorString
const char* dq_gpu_error_name(int code);        // cudaGetErrorName
int dq_gpu_ensure_device(int device);           // cudaSetDevice when not current
int dq_gpu_device_name(int device, char* buf, int buflen);
int dq_gpu_synchronize(uintptr_t stream);       // cudaStreamSynchronize
int dq_gpu_last_error(void);                    // cudaGetLastError (clears it)

// -------------------------------------------------------------- DynamiQ codec
// Statistics (see dq_cpu_stats).  `nonfinite` (one device int64, may be NULL)
// receives the count of non-finite inputs; `tail` (2 device floats, may be
// NULL, not both) the non-finite flag and max |x| of dq_cpu_stats (both
// zeroed first, same stream).
int dq_gpu_stats(const DqSource* S, int64_t nsg, int centre, float* mean, float* norm2,
                 int64_t* nonfinite, float* tail, uintptr_t stream);
// dst[0..1] = {key_value, key_perm}, enqueued on stream (DqParams.key_ptr's target)
int dq_gpu_set_keys(uint32_t* dst, uint32_t key_value, uint32_t key_perm, uintptr_t stream);

// `piece` (every encoder and decoder; NULL for none): the fixed layout's
// device piece {first stream super-group, count, byte offset in the tile}
// (dq_plan.h), read by the kernel, which then ignores the host's sg_base and
// uses nsg only as the piece's capacity (grid size); in and out point at the
// tile.  Decoders into a float32 stream buffer write its row s for stream
// super-group s; the plain encoders shift their source to the piece's first
// super-group.
int dq_gpu_compress(const DqParams* P, const DqSource* local, int64_t nsg, int64_t sg_base,
                    uint32_t event, uint8_t* out, uintptr_t stream, const int64_t* piece);
int dq_gpu_decompress(const DqParams* P, const uint8_t* in, int64_t nsg, float* out,
                      int accumulate, uintptr_t stream, const int64_t* piece);
// out = compress(decode(in) + local), the float32 sum kept in registers.  `in`
// and `out` may be the same buffer.
int dq_gpu_dar(const DqParams* P, const uint8_t* in, const DqSource* local, int64_t nsg,
               int64_t sg_base, uint32_t event, uint8_t* out, uintptr_t stream,
               const int64_t* piece);
// dq_cpu_finish; stream_values NULL: only the rows absent from the stream
// (stream_of_sg < 0) are written, the others are left as they are (filled by
// dq_gpu_decompress_out).  `refuse` (a device plan header, or NULL): when it
// flags non-finite input, means that overflowed, a sum of max |x| above
// `limit`, a layout overflow or another block's refusal, every row is written
// NaN instead (the fixed
// layout's nonfinite="propagate", decided on the device).
int dq_gpu_finish(const float* stream_values, const int64_t* stream_of_sg, const float* mean_sum,
                  int64_t nsg, float divisor, void* out, int dtype, int64_t length,
                  uintptr_t stream, const double* refuse, float limit);
// decompress and finish in one pass for the nsg stream super-groups from
// sg_base: stream super-group s goes to input row order[s] of out, as
// dq_gpu_finish would write it from the decompressed values (same bits).
int dq_gpu_decompress_out(const DqParams* P, const uint8_t* in, int64_t nsg, int64_t sg_base,
                          const int64_t* order, const float* mean_sum, float divisor, void* out,
                          int dtype, int64_t length, uintptr_t stream, const int64_t* piece);
// the same for nsg raw BF16 records of the 16-bit class (256 values each,
// `in` 2-byte aligned): what dq_gpu_bf16_decompress then dq_gpu_finish would
// write (same bits).
int dq_gpu_bf16_decompress_out(const uint16_t* in, int64_t nsg, int64_t sg_base,
                               const int64_t* order, const float* mean_sum, float divisor,
                               void* out, int dtype, int64_t length, uintptr_t stream,
                               const int64_t* piece);

// -------------------------------------------------------------- baselines
// Stream element e (0 <= e < n, n <= nsg * 256: the last super-group may be
// partial) is the source value of stream super-group e / 256 (sg_map /
// sg_offset / mean / zero padding as DqSource).
// bf16:  compress  out[e] = bf16_rne(local(e))
//        decompress out[e] (+)= float(in[e])
//        dar       out[e] = bf16_rne(float(in[e]) + local(e))
// exact: compress  out[e] = local(e)
//        decompress out[e] (+)= in[e]
//        dar       out[e] = in[e] + local(e)
int dq_gpu_bf16_compress(const DqSource* local, int64_t nsg, int64_t n, uint16_t* out,
                         uintptr_t stream, const int64_t* piece);
int dq_gpu_bf16_decompress(const uint16_t* in, int64_t n, float* out, int accumulate,
                           uintptr_t stream, const int64_t* piece);
int dq_gpu_bf16_dar(const uint16_t* in, const DqSource* local, int64_t nsg, int64_t n,
                    uint16_t* out, uintptr_t stream, const int64_t* piece);
int dq_gpu_exact_compress(const DqSource* local, int64_t nsg, int64_t n, float* out,
                          uintptr_t stream, const int64_t* piece);
int dq_gpu_exact_decompress(const float* in, int64_t n, float* out, int accumulate,
                            uintptr_t stream);
int dq_gpu_exact_dar(const float* in, const DqSource* local, int64_t nsg, int64_t n, float* out,
                     uintptr_t stream);

// -------------------------------------------------------------- benchmarking
// Kernel variant for timing studies only (0 = the default).  Applies to the
// 4-bit encoders with independent rounding:
//   2, 3: the default code compiled for 5 / 6 resident blocks per SM (fewer
//      registers, more warps; bit-identical).
// (Variant 1, a one-round-hash study, is gone: the header's generator now
// hashes once per group; any other value runs the default.)
void dq_gpu_set_variant(int variant);
// Tests only: at most `blocks` blocks per encoder launch (0: the resident grid), so
// a small input makes each warp take many grid-stride steps (the correlated
// encoders batch their permutations over 16 steps).  Bit-identical either way.
void dq_gpu_set_encode_grid(int blocks);

#ifdef __cplusplus
}
#endif
