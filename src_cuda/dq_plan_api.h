// dq_plan_api.h -- C API of the planner (math in dq_plan.h).
//
// Inputs are the reduced statistics of the call: norm2[nsg] (squared norms),
// mean_sum[nsg] (may be NULL unless A->centring) and tail[2] (non-finite flag
// sum, sum of max |x|).  Outputs: widths[nsg] (0, 2, 4, 8, 16), order[nsg]
// (stream position -> input super-group: live ones in width order 2, 4, 8, 16,
// each class in input order, then the 0-bit class), stream_of_sg[nsg] (input -> stream
// position, -1 for the 0-bit class) and header[DQ_PLAN_HEADER] (dq_plan.h).
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "dq_plan.h"

#ifdef __cplusplus
extern "C" {
#endif

void dq_cpu_plan(const DqPlanArgs* A, const float* norm2, const float* mean_sum,
                 const float* tail, int8_t* widths, int64_t* order, int64_t* stream_of_sg,
                 double* header);

// GPU: every pointer is a device pointer except A; `scratch` is a device
// buffer of at least dq_gpu_plan_scratch_bytes(nsg) bytes.  Enqueued on
// `stream`; nothing synchronises.  Returns a cudaError_t code.
size_t dq_gpu_plan_scratch_bytes(int64_t nsg);
int dq_gpu_plan(const DqPlanArgs* A, const float* norm2, const float* mean_sum, const float* tail,
                int8_t* widths, int64_t* order, int64_t* stream_of_sg, double* header,
                void* scratch, size_t scratch_bytes, uintptr_t stream);

// The fixed layout (dq_plan.h): the piece table of n chunks of T tiles
// (DQ_TILE_INTS int64 per tile) from the counts in `header`; rb: record bytes
// of the stream runs (2, 4, 8, 16 bits); cap: bytes of one tile's slot.  With
// `wire` (n T slots of cap bytes; may be NULL) the bytes past each tile's
// payload are zeroed (padding travels as zeros).  A tile whose payload would
// exceed cap (impossible for a cap from the budget) gets no pieces and sets
// header[11].
void dq_cpu_plan_pieces(double* header, int64_t n, int64_t T, const int64_t* rb, int64_t cap,
                        int64_t* table, uint8_t* wire);
int dq_gpu_plan_pieces(double* header, int64_t n, int64_t T, const int64_t* rb, int64_t cap,
                       int64_t* table, uint8_t* wire, uintptr_t stream);

#ifdef __cplusplus
}
#endif
