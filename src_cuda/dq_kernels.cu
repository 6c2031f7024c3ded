// dq_kernels.cu -- the codec operations on the GPU (C API: dq_gpu_api.h).
//
// Bit-identical twins of src_cuda/dq_cpu.cpp.  Build with
//   nvcc -fmad=false -ftz=false -prec-div=true -prec-sqrt=true
// (no contraction, IEEE division and denormals, like the host's
// -ffp-contract=off) and keep every reduction in the header's order.
//
// Layout of the encoding kernels (compress and the fused
// decompress-accumulate-recompress "dar"): one warp handles TWO consecutive
// super-groups per step and every lane owns one group of 16 entries
// (lanes 0-15: super-group 2p, lanes 16-31: super-group 2p+1).  So the
// per-group work (scale code, reciprocal, dq_group_rng) is done once per group
// with no shuffles, the 16 values of a lane are read with 16-byte loads
// (BF16: 2 x 16 B, float32: 4 x 16 B), a lane writes its group's 2w code bytes
// with one store, and the super-group maximum needs 4 shuffles.  Level
// tables live in shared memory (copied once per block from the kernel
// parameters); the decoded sum of the fused kernel never leaves registers.
// Each step's inputs are prefetched a step ahead into the registers the
// current step has just unpacked; wire addresses are byte offsets advanced by
// a constant per step (the same offsets for dar's incoming and outgoing run).
//
// Exact rewrites of header code used below (each gives the same bits; the
// tests compare every operation with the CPU on the device, docs/kernels.md):
//  * a = |t| clamped to [0, 1] as __saturatef (NaN -> 0, like the header); the
//    side is the header's x < 0, except that the one-step kernels take a sign
//    bit (of x in the 4-bit signed LUT, of t otherwise), which differs only for
//    -0 and a NaN: there a = 0 and the x < 0 entry k = 0 gives code R too when
//    RN(mag[1] * inv_gap[0]) >= 1 (host_build checks; see encode_group);
//  * level search: the LUT cell floor(a * 2^b) is read from the bits of
//    RZ(1 + a); 4-bit codes use a 128-cell LUT of their own (any LUT that is a
//    lower bound of the level index ends on the same index after the search,
//    host_build() checks the CPU LUT is one); the test "a >= mag[k+1] && k < R-1"
//    reads a per-k check value that is +inf for k = R-1; when the host proves
//    that no cell holds two level boundaries the search is one predicated step;
//  * each (k, sign) has a table entry e = 2k + (t < 0), split in two 8-byte
//    arrays (SmemTables: {check, code} and {base, inv_gap[k] * 2^32}) so the
//    4-bit loads are free of bank conflicts:
//    base = mag[k] (t >= 0) or mag[k+1] (t < 0), code = R + k or R - k - 1, and
//    S = |a - base| * (inv_gap * 2^32) equals p * 2^32 of the header's
//    (a - mag[k]) * inv_gap / (mag[k+1] - a) * inv_gap (the differences are >= 0,
//    RN subtraction is sign-symmetric, and scaling by 2^32 commutes with RN
//    except below FLT_MIN, where both give a zero threshold); tables whose
//    inv_gap * 2^32 overflows use the generic kernels (unscaled, loop search);
//  * dq_scale_code without branches (scale_code below);
//  * dq_round_up: "g32 < (uint32)(thr * 2^32)" with the saturating cvt.rzi.u32
//    (0 for thr <= 0) and thr >= 1 tested on S >= 2^32; with correlated
//    rounding one 64-bit compare, (pi 2^32 + g32) < trunc(n S) (encode_group);
//  * dq_event_uniform: the inner mix32's last xorshift-16 and the outer one's
//    first cancel (an involution), see mix_head / mix_tail;
//  * dq_unit_bf16 without the double division: the smallest BF16 b with
//    255 * b >= max (products exact in float), from a one-multiply estimate
//    and one correction step each way, then the header's saturation step
//    (unit_bf16 below; checked for every non-negative float bit pattern);
//  * x >> 16, x >> 15 inside the per-group hashes are __umulhi(x, 2^16 / 2^17):
//    multiply-high runs on the FMA pipe, relieving the integer ALU;
//  * dq_group_rng once per lane (= per group): the value base, and with
//    correlated rounding the shift base; the super-group's sigma (the header's
//    own dq_permute, dq_sg_sigma) is computed by lane g for the super-group of
//    the half's step g of each batch of 16 steps and read with one shuffle per
//    step; dq_encode_lane per element with j a compile-time constant (the lane
//    multiplier an immediate); the stratum's "if (pi >= n) pi -= n" is
//    min(pi, pi - n) (unsigned);
//  * 8-bit codes are computed from the table offset (R + k or R - k - 1)
//    instead of read: those kernels are bound by shared-memory bank conflicts.
#ifndef DQ_EMU
#include <cuda_runtime.h>
#endif
#include <math.h>
#include <stdio.h>
#include <stddef.h>
#include <string.h>

#include <type_traits>
#ifndef DQ_EMU
#include <mutex>
#include <unordered_map>
#endif

#include "dq_gpu_api.h"

namespace {

// The parts, in dependency order (each file says what it holds).
#include "dq_k_common.cuh"
#include "dq_k_wire.cuh"
#include "dq_k_encode.cuh"
#include "dq_k_decode.cuh"
#include "dq_k_stats.cuh"
#include "dq_k_finish_bf16.cuh"
#include "dq_k_host.cuh"

}  // namespace
#ifndef DQ_EMU

// ================================================================ C API
extern "C" {

int dq_gpu_device_count(int* count) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (count) *count = (e == cudaSuccess) ? n : 0;
    return (int)e;
}
const char* dq_gpu_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }
const char* dq_gpu_error_name(int code) { return cudaGetErrorName((cudaError_t)code); }
int dq_gpu_ensure_device(int device) {
    int cur = -1;
    cudaError_t e = cudaGetDevice(&cur);
    if (e != cudaSuccess) return (int)e;
    if (cur == device) return 0;
    return (int)cudaSetDevice(device);
}
int dq_gpu_device_name(int device, char* buf, int buflen) {
    cudaDeviceProp prop;
    cudaError_t e = cudaGetDeviceProperties(&prop, device);
    if (e != cudaSuccess) return (int)e;
    if (buf && buflen > 0) {
        strncpy(buf, prop.name, (size_t)buflen - 1);
        buf[buflen - 1] = 0;
    }
    return 0;
}
int dq_gpu_synchronize(uintptr_t stream) {
    return (int)cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream));
}
int dq_gpu_last_error(void) { return (int)cudaGetLastError(); }
void dq_gpu_set_variant(int variant) { g_variant = variant; }
void dq_gpu_set_encode_grid(int blocks) { g_encode_grid_cap = blocks > 0 ? blocks : 0; }

int dq_gpu_set_keys(uint32_t* dst, uint32_t key_value, uint32_t key_perm, uintptr_t stream) {
    if (!dst) return (int)cudaErrorInvalidValue;
    k_set_keys<<<1, 1, 0, reinterpret_cast<cudaStream_t>(stream)>>>(dst, key_value, key_perm);
    return launch_result();
}

int dq_gpu_stats(const DqSource* S, int64_t nsg, int centre, float* mean, float* norm2,
                 int64_t* nonfinite, float* tail, uintptr_t stream) {
    cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
    if (!S || !(nonfinite || tail) || (!mean && centre)) return (int)cudaErrorInvalidValue;
    if (S->sg_map || S->mean) return (int)cudaErrorInvalidValue;
    // (the codec's calls ask for the tail's flag alone: one memset, not two)
    cudaError_t e = cudaSuccess;
    if (nonfinite && (e = cudaMemsetAsync(nonfinite, 0, sizeof(int64_t), st)) != cudaSuccess)
        return (int)e;
    if (tail && (e = cudaMemsetAsync(tail, 0, 2 * sizeof(float), st)) != cudaSuccess) return (int)e;
    if (nsg <= 0) return 0;
    unsigned long long* bad = reinterpret_cast<unsigned long long*>(nonfinite);
    if (S->dtype) {
        // a persistent grid of what is resident (64 registers: 4 blocks per
        // SM), not two waves of it
        k_stats_pairs<1><<<grid_resident(k_stats_pairs<1>, (nsg + 1) / 2, kWarps), kThreads, 0, st>>>(
            *S, nsg, centre, mean, norm2, bad, tail);
    } else {
        k_stats_pairs<0><<<grid_resident(k_stats_pairs<0>, (nsg + 1) / 2, kWarps), kThreads, 0, st>>>(
            *S, nsg, centre, mean, norm2, bad, tail);
    }
    return launch_result();
}

int dq_gpu_compress(const DqParams* P, const DqSource* local, int64_t nsg, int64_t sg_base,
                    uint32_t event, uint8_t* out, uintptr_t stream, const int64_t* piece) {
    return launch_encode<false>(P, local, nullptr, nsg, sg_base, event, out, stream, piece);
}

int dq_gpu_dar(const DqParams* P, const uint8_t* in, const DqSource* local, int64_t nsg,
               int64_t sg_base, uint32_t event, uint8_t* out, uintptr_t stream,
               const int64_t* piece) {
    return launch_encode<true>(P, local, in, nsg, sg_base, event, out, stream, piece);
}

int dq_gpu_decompress(const DqParams* P, const uint8_t* in, int64_t nsg, float* out,
                      int accumulate, uintptr_t stream, const int64_t* piece) {
    if (nsg <= 0) return 0;
    if (!P || !in || !out) return (int)cudaErrorInvalidValue;
    int rc = 0;
    const ParamsCache::Entry* pc = g_params_cache.build(P, &rc);
    if (!pc) return rc;
    const KParams& kp = pc->kp;
    cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
    const int64_t chunks = nsg * (DQ_SUPER / 4);
    switch (P->width) {
        case 2: { auto k = k_decompress<2>; k<<<grid_resident(k, chunks, kThreads), kThreads, 0, st>>>(kp, in, nsg, out, accumulate, piece); break; }
        case 4: { auto k = k_decompress<4>; k<<<grid_resident(k, chunks, kThreads), kThreads, 0, st>>>(kp, in, nsg, out, accumulate, piece); break; }
        default: { auto k = k_decompress<8>; k<<<grid_resident(k, chunks, kThreads), kThreads, 0, st>>>(kp, in, nsg, out, accumulate, piece); break; }
    }
    return launch_result();
}

int dq_gpu_decompress_out(const DqParams* P, const uint8_t* in, int64_t nsg, int64_t sg_base,
                          const int64_t* order, const float* mean_sum, float divisor, void* out,
                          int dtype, int64_t length, uintptr_t stream, const int64_t* piece) {
    if (nsg <= 0 || length <= 0) return 0;
    if (!P || !in || !order || !mean_sum || !out || sg_base < 0 || (dtype != 0 && dtype != 1))
        return (int)cudaErrorInvalidValue;
    int rc = 0;
    const ParamsCache::Entry* pc = g_params_cache.build(P, &rc);
    if (!pc) return rc;
    const KParams& kp = pc->kp;
    cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
    const int64_t chunks = nsg * (DQ_SUPER / 4);
    switch (P->width) {
        case 2: { auto k = k_decompress_out<2>; k<<<grid_resident(k, chunks, kThreads), kThreads, 0, st>>>(kp, in, nsg, sg_base, order, mean_sum, divisor, out, dtype, length, piece); break; }
        case 4: { auto k = k_decompress_out<4>; k<<<grid_resident(k, chunks, kThreads), kThreads, 0, st>>>(kp, in, nsg, sg_base, order, mean_sum, divisor, out, dtype, length, piece); break; }
        default: { auto k = k_decompress_out<8>; k<<<grid_resident(k, chunks, kThreads), kThreads, 0, st>>>(kp, in, nsg, sg_base, order, mean_sum, divisor, out, dtype, length, piece); break; }
    }
    return launch_result();
}

int dq_gpu_bf16_decompress_out(const uint16_t* in, int64_t nsg, int64_t sg_base,
                               const int64_t* order, const float* mean_sum, float divisor,
                               void* out, int dtype, int64_t length, uintptr_t stream,
                               const int64_t* piece) {
    if (nsg <= 0 || length <= 0) return 0;
    if (!in || !order || !mean_sum || !out || sg_base < 0 || (dtype != 0 && dtype != 1))
        return (int)cudaErrorInvalidValue;
    cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
    k_bf16_decompress_out<<<grid_for(nsg * (DQ_SUPER / 8), kThreads), kThreads, 0, st>>>(
        in, nsg, sg_base, order, mean_sum, divisor, out, dtype, length, piece);
    return launch_result();
}

int dq_gpu_finish(const float* stream_values, const int64_t* stream_of_sg, const float* mean_sum,
                  int64_t nsg, float divisor, void* out, int dtype, int64_t length,
                  uintptr_t stream, const double* refuse, float limit) {
    if (nsg <= 0 || length <= 0) return 0;
    if (!stream_of_sg || !mean_sum || !out || (dtype != 0 && dtype != 1))
        return (int)cudaErrorInvalidValue;
    cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
    k_finish<<<grid_for(nsg * 32, kThreads), kThreads, 0, st>>>(
        stream_values, stream_of_sg, mean_sum, nsg, divisor, out, dtype, length, refuse, limit);
    return launch_result();
}

int dq_gpu_bf16_compress(const DqSource* local, int64_t nsg, int64_t n, uint16_t* out,
                         uintptr_t stream, const int64_t* piece) {
    return launch_plain_encode<0>(local, nsg, n, nullptr, out, stream, piece);
}
int dq_gpu_bf16_dar(const uint16_t* in, const DqSource* local, int64_t nsg, int64_t n,
                    uint16_t* out, uintptr_t stream, const int64_t* piece) {
    return launch_plain_encode<1>(local, nsg, n, in, out, stream, piece);
}
int dq_gpu_exact_compress(const DqSource* local, int64_t nsg, int64_t n, float* out,
                          uintptr_t stream, const int64_t* piece) {
    return launch_plain_encode<2>(local, nsg, n, nullptr, out, stream, piece);
}
int dq_gpu_exact_dar(const float* in, const DqSource* local, int64_t nsg, int64_t n, float* out,
                     uintptr_t stream) {
    return launch_plain_encode<3>(local, nsg, n, in, out, stream, nullptr);
}
int dq_gpu_bf16_decompress(const uint16_t* in, int64_t n, float* out, int accumulate,
                           uintptr_t stream, const int64_t* piece) {
    if (n <= 0) return 0;
    if (!in || !out) return (int)cudaErrorInvalidValue;
    k_plain_decode<true><<<grid_for((n + 7) / 8, kThreads), kThreads, 0,
                           reinterpret_cast<cudaStream_t>(stream)>>>(in, n, out, accumulate, piece);
    return launch_result();
}
int dq_gpu_exact_decompress(const float* in, int64_t n, float* out, int accumulate,
                            uintptr_t stream) {
    if (n <= 0) return 0;
    if (!in || !out) return (int)cudaErrorInvalidValue;
    k_plain_decode<false><<<grid_for((n + 7) / 8, kThreads), kThreads, 0,
                            reinterpret_cast<cudaStream_t>(stream)>>>(in, n, out, accumulate,
                                                                       nullptr);
    return launch_result();
}

}  // extern "C"
#endif  // DQ_EMU
