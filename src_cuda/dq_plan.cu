// dq_plan.cu -- the planner on the GPU (CPU twin: dq_plan_cpu.cpp), so a call
// on device arrays plans without a host round trip: five small kernels and
// one CUB radix sort, all enqueued on the caller's stream.
//
//  1. keys: the saturated norm bits (0 for the 0-bit class), live count, mean check;
//  2. (variable widths) sort the keys; a parallel search along each candidate
//     list (theta = 512 F_i and 17 F_i, and S16 F_i with the 16-bit class)
//     finds the first whose cost fits, the
//     upgrades counted by binary search (exact float64 products), and the
//     smaller of the two lowers theta with an atomic min on its bits (the bit
//     patterns of positive doubles order like their values);
//  3. classes: the width of every super-group, class counts per block;
//  4. one block scans the per-block counts into stream offsets and writes the header;
//  5. scatter: stable positions within each class (warp ballots), order and its inverse.
// Every comparison is exact, so the plan equals dq_cpu_plan's bit for bit.
// Steady calls (same arguments, same buffers) replay the launches as one CUDA
// graph, captured on the first such call (DYNAMIQ_PLAN_GRAPH=0: plain launches).
#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>

#include <mutex>

#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>

#include "dq_plan_api.h"

namespace {

constexpr int kThreads = 256;
constexpr int kScanThreads = 1024;
constexpr unsigned long long kInfBits = 0x7ff0000000000000ull;

struct Counters {
    unsigned long long n_live;
    unsigned long long theta_bits;
    unsigned long long counts[DQ_PLAN_CLASSES];
    unsigned int means_bad;
    unsigned int pad;
};

struct Layout {
    size_t counters, keys, sorted, block_counts, block_offsets, temp, temp_bytes, total;
};

size_t align_up(size_t v) { return (v + 255) & ~(size_t)255; }

Layout layout_for(int64_t m) {
    Layout L;
    const int64_t nblk = (m + kThreads - 1) / kThreads;
    size_t temp = 0;
    cub::DeviceRadixSort::SortKeys(nullptr, temp, (const uint32_t*)nullptr, (uint32_t*)nullptr,
                                   (int)(m > 0 ? m : 1), 0, 31);
    L.counters = 0;
    L.keys = align_up(sizeof(Counters));
    L.sorted = L.keys + align_up((size_t)m * 4);
    L.block_counts = L.sorted + align_up((size_t)m * 4);
    L.block_offsets = L.block_counts + align_up((size_t)nblk * DQ_PLAN_CLASSES * 8);
    L.temp = L.block_offsets + align_up((size_t)nblk * DQ_PLAN_CLASSES * 8);
    L.temp_bytes = temp;
    L.total = L.temp + align_up(temp);
    return L;
}

__global__ void __launch_bounds__(kThreads)
k_plan_keys(const DqPlanArgs A, const float* norm2, const float* mean_sum, uint32_t* keys,
            Counters* C) {
    if (blockIdx.x == 0 && threadIdx.x == 0) C->theta_bits = kInfBits;
    unsigned long long live_count = 0;
    unsigned int bad = 0;
    for (int64_t g = (int64_t)blockIdx.x * kThreads + threadIdx.x; g < A.nsg;
         g += (int64_t)gridDim.x * kThreads) {
        const uint32_t k = dq_plan_key(norm2[g]);
        const int live = A.zero_class ? k != 0u : 1;
        keys[g] = live ? k : 0u;
        live_count += live;
        if (A.centring && !isfinite(mean_sum[g])) bad = 1;
    }
    for (int h = 16; h >= 1; h >>= 1) {
        live_count += __shfl_xor_sync(0xffffffffu, live_count, h);
        bad |= __shfl_xor_sync(0xffffffffu, bad, h);
    }
    // one atomic per block, not per warp: 16k warps on one counter serialised
    // (ncu: 16.5 us for this kernel at 2^19 super-groups)
    __shared__ unsigned long long warp_live[kThreads / 32];
    __shared__ unsigned int warp_bad[kThreads / 32];
    if ((threadIdx.x & 31) == 0) {
        warp_live[threadIdx.x >> 5] = live_count;
        warp_bad[threadIdx.x >> 5] = bad;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long total = 0;
        unsigned int any_bad = 0;
        for (int w = 0; w < kThreads / 32; w++) {
            total += warp_live[w];
            any_bad |= warp_bad[w];
        }
        if (total) atomicAdd(&C->n_live, total);
        if (any_bad) atomicOr(&C->means_bad, 1u);
    }
}

__device__ __forceinline__ double budget_for(const DqPlanArgs& A, int64_t base) {
    return (double)base > A.budget_bits ? A.padded_budget_bits : A.budget_bits;
}

// theta: the smallest candidate 512 F_i or 17 F_i (or S16 F_i) (F_i > 0) whose
// cost fits the budget.  The cost falls as theta grows, so along any ascending
// candidate list "fits" is false ... false, true ... true: block 0 searches the
// 512 F_i, block 1 the 17 F_i, block 2 (16-bit class) the S16 F_i, each by a 1024-ary search (every round evaluates 1024
// evenly spaced candidates of the remaining range, two binary searches each in
// the L2-resident keys; 2^19 candidates take three rounds).  The smaller of the
// two first fits lowers theta with an atomic min on its bits.  (A thread per
// candidate, the earlier kernel, took 137 us at 2^19 super-groups on an H200.)
__global__ void __launch_bounds__(kScanThreads)
k_plan_theta(const DqPlanArgs A, const uint32_t* asc, Counters* C) {
    __shared__ long long first_fit;
    const int64_t m = A.nsg;
    const double scale = blockIdx.x == 0 ? 512.0 : blockIdx.x == 1 ? 17.0 : DQ_PLAN_S16;
    const int64_t base = A.stats_bits + (int64_t)C->n_live * A.rec_bits[0];
    const double budget = budget_for(A, base);
    int64_t lo = dq_plan_first_at_least(asc, m, 1.0, 1e-300);   // candidates need F > 0
    int64_t hi = m;                                             // the answer is in [lo, hi]
    while (lo < hi) {
        const int64_t step = (hi - lo + kScanThreads - 1) / kScanThreads;
        if (threadIdx.x == 0) first_fit = hi;
        __syncthreads();
        const int64_t i = lo + (int64_t)threadIdx.x * step;
        if (i < hi) {
            const double theta = scale * dq_plan_value(asc[i]);
            if ((double)dq_plan_cost(&A, asc, m, base, theta) <= budget) atomicMin(&first_fit, (long long)i);
        }
        __syncthreads();
        const int64_t fit = first_fit;
        __syncthreads();
        // the first fit lies in (fit - step, fit]: the candidate before it failed
        const int64_t prev = fit - step;
        lo = prev + 1 > lo ? prev + 1 : lo;
        hi = fit;
        if (step == 1) lo = hi;
    }
    if (threadIdx.x == 0 && hi < m) {
        const double theta = scale * dq_plan_value(asc[hi]);
        atomicMin(&C->theta_bits, (unsigned long long)__double_as_longlong(theta));
    }
}

__device__ __forceinline__ int class_of_width(int w) {
    return w == 2 ? 0 : w == 4 ? 1 : w == 8 ? 2 : w == 16 ? 4 : 3;
}

__global__ void __launch_bounds__(kThreads)
k_plan_classes(const DqPlanArgs A, const float* norm2, Counters* C, int8_t* widths,
               long long* block_counts, int64_t nblk) {
    const int64_t g = (int64_t)blockIdx.x * kThreads + threadIdx.x;
    int c = -1;
    if (g < A.nsg) {
        const uint32_t k = dq_plan_key(norm2[g]);
        const int live = A.zero_class ? k != 0u : 1;
        if (!A.variable) {
            c = live ? dq_plan_fixed_class(&A, (int64_t)C->n_live) : 3;
        } else {
            const double theta = __longlong_as_double((long long)C->theta_bits);
            c = dq_plan_class(dq_plan_value(k), live, theta, A.bf16_class);
        }
        widths[g] = (int8_t)dq_plan_width_of_class(c);
    }
    for (int q = 0; q < DQ_PLAN_CLASSES; q++) {
        const int n = __syncthreads_count(c == q);
        if (threadIdx.x == 0) {
            block_counts[q * nblk + blockIdx.x] = n;
            if (n) atomicAdd(&C->counts[q], (unsigned long long)n);
        }
    }
}

__global__ void __launch_bounds__(kScanThreads)
k_plan_scan(const DqPlanArgs A, const float* tail, const Counters* C, const long long* block_counts,
            long long* block_offsets, int64_t nblk, double* header) {
    typedef cub::BlockScan<long long, kScanThreads> Scan;
    __shared__ typename Scan::TempStorage tmp;
    int64_t counts[DQ_PLAN_CLASSES], start[DQ_PLAN_CLASSES];
    for (int q = 0; q < DQ_PLAN_CLASSES; q++) counts[q] = (int64_t)C->counts[q];
    dq_plan_starts(counts, start);
    const int64_t seg = (nblk + kScanThreads - 1) / kScanThreads;
    const int64_t b0 = (int64_t)threadIdx.x * seg;
    const int64_t b1 = b0 + seg < nblk ? b0 + seg : nblk;
    for (int q = 0; q < DQ_PLAN_CLASSES; q++) {
        long long mine = 0;
        for (int64_t b = b0; b < b1; b++) mine += block_counts[q * nblk + b];
        long long before;
        Scan(tmp).ExclusiveSum(mine, before);
        __syncthreads();
        long long run = start[q] + before;
        for (int64_t b = b0; b < b1; b++) {
            block_offsets[q * nblk + b] = run;
            run += block_counts[q * nblk + b];
        }
    }
    if (threadIdx.x == 0) {
        const long long total = dq_plan_total(&A, counts);
        header[0] = tail[0];
        header[1] = tail[1];
        header[2] = C->means_bad ? 0.0 : 1.0;
        header[3] = (double)total > A.budget_bits ? 1.0 : 0.0;
        for (int q = 0; q < 4; q++) header[4 + q] = (double)counts[q];
        header[8] = A.variable ? __longlong_as_double((long long)C->theta_bits) : nan("");
        header[9] = (double)total;
        header[10] = (double)counts[4];
        header[11] = 0.0;
        header[12] = 0.0;
    }
}

__global__ void __launch_bounds__(kThreads)
k_plan_scatter(const DqPlanArgs A, const int8_t* widths, const long long* block_offsets,
               int64_t nblk, int64_t* order, int64_t* stream_of_sg) {
    __shared__ int warp_counts[kThreads / 32][DQ_PLAN_CLASSES];
    const int64_t g = (int64_t)blockIdx.x * kThreads + threadIdx.x;
    const int c = g < A.nsg ? class_of_width(widths[g]) : -1;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned lt = (1u << lane) - 1u;
    int rank = 0;
    for (int q = 0; q < DQ_PLAN_CLASSES; q++) {
        const unsigned mask = __ballot_sync(0xffffffffu, c == q);
        if (c == q) rank = __popc(mask & lt);
        if (lane == 0) warp_counts[warp][q] = __popc(mask);
    }
    __syncthreads();
    if (c < 0) return;
    long long pos = block_offsets[c * nblk + blockIdx.x] + rank;
    for (int w = 0; w < warp; w++) pos += warp_counts[w][c];
    order[pos] = g;
    stream_of_sg[g] = c == 3 ? -1 : pos;
}

// The fixed layout's piece table (dq_plan.h), one block per tile: thread 0
// cuts the tile from the header's counts, then the block zeroes the slot's
// bytes past the payload (16-byte stores where the slot allows).
struct RecBytes { int64_t rb[4]; };

__global__ void __launch_bounds__(kThreads)
k_plan_pieces(double* header, int64_t n, int64_t T, const RecBytes R, int64_t cap, int64_t* table,
              uint8_t* wire) {
    __shared__ int64_t payload;
    int64_t counts4[4];
    dq_plan_run_counts(header, counts4);
    DqRuns L;
    dq_runs_init(&L, counts4, R.rb);
    for (int64_t t = blockIdx.x; t < n * T; t += gridDim.x) {
        if (threadIdx.x == 0)
            payload = dq_plan_tile_checked(&L, n, T, t, cap, table + t * DQ_TILE_INTS, header);
        __syncthreads();
        if (wire) {
            uint8_t* slot = wire + t * cap;
            int64_t a = payload;
            const int64_t a16 = (a + 15) & ~(int64_t)15;
            const bool vec = (reinterpret_cast<uintptr_t>(slot) & 15) == 0 && (cap & 15) == 0;
            const int64_t head_end = vec ? (a16 < cap ? a16 : cap) : cap;
            for (int64_t i = a + threadIdx.x; i < head_end; i += blockDim.x) slot[i] = 0;
            if (vec)
                for (int64_t i = a16 / 16 + threadIdx.x; i < cap / 16; i += blockDim.x)
                    reinterpret_cast<uint4*>(slot)[i] = make_uint4(0u, 0u, 0u, 0u);
        }
        __syncthreads();
    }
}

int grid_of(int64_t items) {
    int64_t b = (items + kThreads - 1) / kThreads;
    if (b > 132 * 16) b = 132 * 16;     // grid-stride beyond a few waves
    return b < 1 ? 1 : (int)b;
}

// The planner's launches on stream st (about a dozen with the sort).
int enqueue_plan(const DqPlanArgs* A, const float* norm2, const float* mean_sum, const float* tail,
                 int8_t* widths, int64_t* order, int64_t* stream_of_sg, double* header,
                 void* scratch, const Layout& L, cudaStream_t st) {
    const int64_t m = A->nsg;
    char* base = static_cast<char*>(scratch);
    Counters* C = reinterpret_cast<Counters*>(base + L.counters);
    uint32_t* keys = reinterpret_cast<uint32_t*>(base + L.keys);
    uint32_t* sorted = reinterpret_cast<uint32_t*>(base + L.sorted);
    long long* block_counts = reinterpret_cast<long long*>(base + L.block_counts);
    long long* block_offsets = reinterpret_cast<long long*>(base + L.block_offsets);
    const int64_t nblk = (m + kThreads - 1) / kThreads;

    cudaError_t e = cudaMemsetAsync(C, 0, sizeof(Counters), st);
    if (e != cudaSuccess) return (int)e;
    if (m > 0) {
        k_plan_keys<<<grid_of(m), kThreads, 0, st>>>(*A, norm2, mean_sum, keys, C);
        if (A->variable) {
            size_t temp = L.temp_bytes;
            e = cub::DeviceRadixSort::SortKeys(base + L.temp, temp, keys, sorted, (int)m, 0, 31, st);
            if (e != cudaSuccess) return (int)e;
            k_plan_theta<<<A->bf16_class ? 3 : 2, kScanThreads, 0, st>>>(*A, sorted, C);
        }
        k_plan_classes<<<(unsigned)nblk, kThreads, 0, st>>>(*A, norm2, C, widths, block_counts, nblk);
    }
    k_plan_scan<<<1, kScanThreads, 0, st>>>(*A, tail, C, block_counts, block_offsets, nblk, header);
    if (m > 0)
        k_plan_scatter<<<(unsigned)nblk, kThreads, 0, st>>>(*A, widths, block_offsets, nblk, order,
                                                            stream_of_sg);
    return (int)cudaGetLastError();
}

// Steady calls plan with the same arguments into the same buffers (the
// Collective's workspace): their launches are captured once as a CUDA graph
// and replayed, one launch instead of a dozen (host and device gaps).  A
// graph bakes in every argument and pointer, so all of them are the key.
// DYNAMIQ_PLAN_GRAPH=0 enqueues the kernels one by one (for A/B runs).
struct GraphKey {
    DqPlanArgs a;
    const void* ptrs[8];
    size_t scratch_bytes;
    int device;
};
struct GraphEntry {
    GraphKey key;
    cudaGraphExec_t exec = nullptr;
};
constexpr int kGraphs = 8;
std::mutex g_graph_mu;
GraphEntry g_graphs[kGraphs];
int g_graph_next = 0;
cudaStream_t g_capture[64] = {};      // per device: the stream captures run on

bool graphs_enabled() {
    const char* v = getenv("DYNAMIQ_PLAN_GRAPH");
    return !(v && v[0] == '0' && v[1] == 0);
}

// The graph of these launches, captured on first use; nullptr if capturing failed.
cudaGraphExec_t plan_graph(const GraphKey& key, const DqPlanArgs* A, const float* norm2,
                           const float* mean_sum, const float* tail, int8_t* widths,
                           int64_t* order, int64_t* stream_of_sg, double* header, void* scratch,
                           const Layout& L) {
    for (GraphEntry& g : g_graphs)
        if (g.exec && memcmp(&g.key, &key, sizeof(GraphKey)) == 0) return g.exec;
    if (key.device < 0 || key.device >= 64) return nullptr;
    cudaStream_t& cap = g_capture[key.device];
    if (!cap && cudaStreamCreateWithFlags(&cap, cudaStreamNonBlocking) != cudaSuccess) {
        cap = nullptr;
        cudaGetLastError();
        return nullptr;
    }
    if (cudaStreamBeginCapture(cap, cudaStreamCaptureModeRelaxed) != cudaSuccess) {
        cudaGetLastError();
        return nullptr;
    }
    const int rc = enqueue_plan(A, norm2, mean_sum, tail, widths, order, stream_of_sg, header,
                                scratch, L, cap);
    cudaGraph_t graph = nullptr;
    const cudaError_t end = cudaStreamEndCapture(cap, &graph);
    cudaGraphExec_t exec = nullptr;
    if (rc == 0 && end == cudaSuccess && graph &&
        cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess)
        exec = nullptr;
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();               // a failed capture falls back to plain launches
    if (!exec) return nullptr;
    GraphEntry& slot = g_graphs[g_graph_next];
    g_graph_next = (g_graph_next + 1) % kGraphs;
    if (slot.exec) cudaGraphExecDestroy(slot.exec);   // one still running is freed when done
    slot.key = key;
    slot.exec = exec;
    return exec;
}

}  // namespace

extern "C" {

size_t dq_gpu_plan_scratch_bytes(int64_t nsg) { return layout_for(nsg).total; }

int dq_gpu_plan(const DqPlanArgs* A, const float* norm2, const float* mean_sum, const float* tail,
                int8_t* widths, int64_t* order, int64_t* stream_of_sg, double* header,
                void* scratch, size_t scratch_bytes, uintptr_t stream) {
    if (!A || !norm2 || !tail || !widths || !order || !stream_of_sg || !header || !scratch)
        return (int)cudaErrorInvalidValue;
    if (A->centring && !mean_sum) return (int)cudaErrorInvalidValue;
    const int64_t m = A->nsg;
    if (m < 0 || m > (int64_t)0x7fffffff) return (int)cudaErrorInvalidValue;
    const Layout L = layout_for(m);
    if (scratch_bytes < L.total) return (int)cudaErrorInvalidValue;
    cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
    // inside a capture of the caller's (a whole call captured as one graph),
    // the launches themselves become part of that graph
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(st, &capturing) != cudaSuccess) {
        cudaGetLastError();
        capturing = cudaStreamCaptureStatusNone;
    }
    if (graphs_enabled() && capturing == cudaStreamCaptureStatusNone) {
        GraphKey key;
        memset(&key, 0, sizeof(key));
        key.a = *A;
        key.a.pad_ = 0;
        const void* ptrs[8] = {norm2, A->centring ? mean_sum : nullptr, tail, widths, order,
                               stream_of_sg, header, scratch};
        memcpy(key.ptrs, ptrs, sizeof(ptrs));
        key.scratch_bytes = scratch_bytes;
        if (cudaGetDevice(&key.device) != cudaSuccess) key.device = -1;
        std::lock_guard<std::mutex> lock(g_graph_mu);
        cudaGraphExec_t exec = plan_graph(key, A, norm2, mean_sum, tail, widths, order,
                                          stream_of_sg, header, scratch, L);
        if (exec) return (int)cudaGraphLaunch(exec, st);
    }
    return enqueue_plan(A, norm2, mean_sum, tail, widths, order, stream_of_sg, header, scratch,
                        L, st);
}

int dq_gpu_plan_pieces(double* header, int64_t n, int64_t T, const int64_t* rb, int64_t cap,
                       int64_t* table, uint8_t* wire, uintptr_t stream) {
    if (!header || !rb || !table || n < 1 || T < 1 || cap < 0) return (int)cudaErrorInvalidValue;
    RecBytes R;
    for (int k = 0; k < 4; k++) R.rb[k] = rb[k] > 0 ? rb[k] : 1;
    const int64_t tiles = n * T;
    const unsigned grid = (unsigned)(tiles < 4096 ? tiles : 4096);
    k_plan_pieces<<<grid, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
        header, n, T, R, cap, table, wire);
    return (int)cudaGetLastError();
}

}  // extern "C"
