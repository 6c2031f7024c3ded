// dq_plan.h -- the per-call plan of the DynamiQ codec (variable widths, the
// stable reorder into width runs), shared by the CPU (dq_plan_cpu.cpp) and the
// GPU (dq_plan.cu).  Everything here is exact: norms are float32 values
// compared as float64 products by 17 and 512 (exact), counts are integers, so
// both sides produce the same plan bit for bit with no log2 anywhere.
//
// The rule (paper Appendix A, spec section 2.3): with theta = 512 T, a live
// super-group gets 8 bits iff 17 F >= theta, 4 bits iff 512 F >= theta, else
// 2 bits; theta is the smallest candidate (a value 512 F_i or 17 F_i) whose
// total cost fits the budget.  With the optional 16-bit class (raw BF16, the
// paper's large-scale simulation, spec 2.3's option) a super-group gets 16 bits
// iff S16 F >= theta, S16 = 17 * 257 / 2^17 (the paper's T_{8,16} = 2^17/257
// T_{4,8}; exact in float64), and S16 F_i are candidates too.
// dynamiq_mpi/codecs/allocation.py holds the same rule as readable array code
// (the tests' reference).
#pragma once
#include <stdint.h>

#include "dq_codec.h"

typedef struct DqPlanArgs {
    int64_t nsg;               // super-groups (m)
    int32_t centring;          // mean_sum is given: check it is finite
    int32_t zero_class;        // F == 0 -> 0-bit class
    int32_t variable;          // 0: one width for every live super-group
    int32_t fixed_width;       // with !variable: 2, 4 or 8, or 0 = the widest that fits
    int64_t stats_bits;        // statistics of the call, all ranks' share counted once
    int64_t rec_bits[4];       // wire bits of one super-group of 2-, 4-, 8-bit codes, raw BF16
    double budget_bits;        // bits * length
    double padded_budget_bits; // used when even every live super-group at 2 bits exceeds it
    int32_t bf16_class;        // 1: the 16-bit (raw BF16) class is allowed (variable widths)
    int32_t pad_;
} DqPlanArgs;

// Header written by the planner (one small copy to the host):
//   [0] tail[0] (ranks with non-finite input)   [1] tail[1] (sum of max |x|)
//   [2] 1 if every mean_sum is finite            [3] 1 if the total exceeds budget_bits
//   [4..7] super-groups at 2, 4, 8 bits and in the 0-bit class
//   [8] theta (+inf: all live at 2 bits; NaN: one fixed width)   [9] total bits
//   [10] super-groups at 16 bits (raw BF16)
//   [11] 1 if a tile's payload exceeded its slot in the fixed layout (never, by
//        construction of the capacity; the call then refuses like non-finite input)
//   [12] 1 if another block of the call refused (a reduce-scatter in the fixed
//        layout: the engine sets it on the device; the call refuses alike)
#define DQ_PLAN_HEADER 13
// Classes: 0, 1, 2 = 2, 4, 8 bits; 3 = the 0-bit class; 4 = 16 bits.  Stream
// order: classes 0, 1, 2, 4; the 0-bit class is not in the stream.
#define DQ_PLAN_CLASSES 5
#define DQ_PLAN_S16 (4369.0 / 131072.0)

#define DQ_FLT_MAX_BITS 0x7f7fffffu

// Saturated norm bits: inf and NaN (only from non-finite input, which the
// caller refuses) become FLT_MAX; the sign bit is cleared (norms are >= 0).
DQ_HD uint32_t dq_plan_key(float f) {
    uint32_t u = dq_f2u(f) & 0x7fffffffu;
    return u >= 0x7f800000u ? DQ_FLT_MAX_BITS : u;
}
// The norm as a double, exactly (denormals included: no float op touches it).
DQ_HD double dq_plan_value(uint32_t key) { return (double)dq_u2f(key); }

// Class index of a width: 0, 1, 2 for 2, 4, 8 bits; 3 for the 0-bit class;
// 4 for 16 bits (only with bf16).
DQ_HD int dq_plan_class(double F, int live, double theta, int bf16) {
    if (!live) return 3;
    if (bf16 && DQ_PLAN_S16 * F >= theta) return 4;
    if (17.0 * F >= theta) return 2;
    if (512.0 * F >= theta) return 1;
    return 0;
}
DQ_HD int dq_plan_width_of_class(int c) { return c == 3 ? 0 : c == 4 ? 16 : (2 << c); }
// First stream position of each class (stream order 0, 1, 2, 4; the 0-bit class after).
DQ_HD void dq_plan_starts(const int64_t* counts, int64_t* start) {
    start[0] = 0;
    start[1] = counts[0];
    start[2] = counts[0] + counts[1];
    start[4] = counts[0] + counts[1] + counts[2];
    start[3] = start[4] + counts[4];
}
DQ_HD int64_t dq_plan_total(const DqPlanArgs* A, const int64_t* counts) {
    return A->stats_bits + counts[0] * A->rec_bits[0] + counts[1] * A->rec_bits[1]
           + counts[2] * A->rec_bits[2] + counts[4] * A->rec_bits[3];
}

// Width (class) chosen when one width serves every live super-group.
DQ_HD int dq_plan_fixed_class(const DqPlanArgs* A, int64_t n_live) {
    if (A->fixed_width) return A->fixed_width == 2 ? 0 : A->fixed_width == 4 ? 1 : 2;
    const double budget = (double)(A->stats_bits + n_live * A->rec_bits[0]) > A->budget_bits
                          ? A->padded_budget_bits : A->budget_bits;
    if ((double)(A->stats_bits + n_live * A->rec_bits[2]) <= budget) return 2;
    if ((double)(A->stats_bits + n_live * A->rec_bits[1]) <= budget) return 1;
    return 0;
}

// First index i in [0, m) of the ascending keys with pred(value(i)) true, for a
// monotone predicate "scale * F >= target" (F ascending => false..true).
DQ_HD int64_t dq_plan_first_at_least(const uint32_t* asc, int64_t m, double scale, double target) {
    int64_t lo = 0, hi = m;
    while (lo < hi) {
        int64_t mid = lo + ((hi - lo) >> 1);
        if (scale * dq_plan_value(asc[mid]) >= target) hi = mid; else lo = mid + 1;
    }
    return lo;
}

// Cost of theta = s * F_i (s = 512 or 17) given the ascending keys: base plus
// the upgrades of every super-group the threshold reaches.
DQ_HD int64_t dq_plan_cost(const DqPlanArgs* A, const uint32_t* asc, int64_t m, int64_t base,
                           double theta) {
    const int64_t fours = m - dq_plan_first_at_least(asc, m, 512.0, theta);
    const int64_t eights = m - dq_plan_first_at_least(asc, m, 17.0, theta);
    int64_t cost = base + (A->rec_bits[1] - A->rec_bits[0]) * fours
                   + (A->rec_bits[2] - A->rec_bits[1]) * eights;
    if (A->bf16_class)
        cost += (A->rec_bits[3] - A->rec_bits[2]) * (m - dq_plan_first_at_least(asc, m, DQ_PLAN_S16, theta));
    return cost;
}

// ---------------------------------------------------------------- fixed layout
// The cut of a call's compressed stream into n chunks of (nearly) equal wire
// bytes and of every chunk into T tiles, from the class counts alone: the
// layout a call on device arrays computes on the device, so that the host
// enqueues every kernel and message without reading the plan back (each tile
// travels in a slot of fixed capacity, its size known from the budget).  The
// cuts equal StreamLayout.split / tile_stream of codecs/base.py (integer
// arithmetic, the same formulas), so a call decodes the same bits whichever
// layout it used: the generator is keyed by stream position, and chunk c's
// events by its ranks' roles, both unchanged.
//
// Piece table: DQ_TILE_ENTRIES entries of 4 int64 per tile.  Entries 0..3:
// the tile's piece of each stream class (2, 4, 8, 16 bits): {first stream
// super-group, count, byte offset in the tile, bytes}; count 0 when the tile
// holds none.  Entry 4: {first super-group of the tile, super-groups,
// first * 256 * 4 (byte offset of its rows in a float32 stream buffer),
// payload bytes of the tile}.  The kernels read their piece from it.
#define DQ_TILE_ENTRIES 5
#define DQ_TILE_INTS (4 * DQ_TILE_ENTRIES)

typedef struct DqRuns {
    int64_t starts[5];    // stream index where each run starts (runs: classes 0, 1, 2, 4)
    int64_t bstarts[5];   // its byte offset
    int64_t rb[4];        // record bytes of each run
} DqRuns;

DQ_HD void dq_runs_init(DqRuns* L, const int64_t* counts4, const int64_t* rb) {
    L->starts[0] = 0;
    L->bstarts[0] = 0;
    for (int k = 0; k < 4; k++) {
        L->rb[k] = rb[k];
        L->starts[k + 1] = L->starts[k] + counts4[k];
        L->bstarts[k + 1] = L->bstarts[k] + counts4[k] * rb[k];
    }
}
// Byte offset of unit s (StreamLayout.offset).
DQ_HD int64_t dq_runs_offset(const DqRuns* L, int64_t s) {
    for (int k = 0; k < 4; k++)
        if (s <= L->starts[k + 1]) return L->bstarts[k] + (s - L->starts[k]) * L->rb[k];
    return L->bstarts[4];
}
// The smallest unit s with offset(s) >= t (StreamLayout.cut).
DQ_HD int64_t dq_runs_cut(const DqRuns* L, int64_t t) {
    if (t <= 0) return 0;
    for (int k = 0; k < 4; k++) {
        const int64_t c = L->starts[k + 1] - L->starts[k];
        if (c && L->bstarts[k + 1] >= t)
            return L->starts[k] + (t - L->bstarts[k] + L->rb[k] - 1) / L->rb[k];
    }
    return L->starts[4];
}
// Bound k of StreamLayout.split(lo, hi, parts).  Its loop clamps every cut
// between the previous bound and hi; record bytes are positive, so offsets
// rise strictly and cut() is monotone with cut(offset(lo)) = lo and
// cut(offset(hi)) = hi: clamping to [lo, hi] gives the same bounds.
DQ_HD int64_t dq_runs_split_bound(const DqRuns* L, int64_t lo, int64_t hi, int64_t parts,
                                  int64_t k) {
    if (k <= 0) return lo;
    if (k >= parts) return hi;
    const int64_t b0 = dq_runs_offset(L, lo), b1 = dq_runs_offset(L, hi);
    int64_t c = dq_runs_cut(L, b0 + (k * (b1 - b0)) / parts);
    if (c < lo) c = lo;
    if (c > hi) c = hi;
    return c;
}
// The table rows of tile t = c * T + j (chunk c of n, tile j of T); returns
// the tile's payload bytes.
DQ_HD int64_t dq_plan_tile(const DqRuns* L, int64_t n, int64_t T, int64_t t, int64_t* row) {
    const int64_t c = t / T, j = t % T, count = L->starts[4];
    const int64_t ca = dq_runs_split_bound(L, 0, count, n, c);
    const int64_t cb = dq_runs_split_bound(L, 0, count, n, c + 1);
    const int64_t a = dq_runs_split_bound(L, ca, cb, T, j);
    const int64_t b = dq_runs_split_bound(L, ca, cb, T, j + 1);
    const int64_t base = dq_runs_offset(L, a);
    for (int k = 0; k < 4; k++) {
        const int64_t s0 = a > L->starts[k] ? a : L->starts[k];
        const int64_t s1 = b < L->starts[k + 1] ? b : L->starts[k + 1];
        int64_t* e = row + 4 * k;
        if (s1 > s0) {
            e[0] = s0;
            e[1] = s1 - s0;
            e[2] = dq_runs_offset(L, s0) - base;
            e[3] = (s1 - s0) * L->rb[k];
        } else {
            e[0] = s0 < s1 ? s0 : s1;
            e[1] = 0;
            e[2] = 0;
            e[3] = 0;
        }
    }
    const int64_t bytes = dq_runs_offset(L, b) - base;
    int64_t* r = row + 16;
    r[0] = a;
    r[1] = b - a;
    r[2] = a * DQ_SUPER * 4;
    r[3] = bytes;
    return bytes;
}
// Class counts of the stream runs (2, 4, 8, 16 bits) from a plan header.
DQ_HD void dq_plan_run_counts(const double* header, int64_t* counts4) {
    counts4[0] = (int64_t)header[4];
    counts4[1] = (int64_t)header[5];
    counts4[2] = (int64_t)header[6];
    counts4[3] = (int64_t)header[10];
}
// The table rows of tile t, refused (no pieces, header[11] set) if its
// payload exceeds its slot of cap bytes; returns the payload bytes kept.
DQ_HD int64_t dq_plan_tile_checked(const DqRuns* L, int64_t n, int64_t T, int64_t t, int64_t cap,
                                   int64_t* row, double* header) {
    const int64_t bytes = dq_plan_tile(L, n, T, t, row);
    if (bytes <= cap) return bytes;
    for (int k = 0; k < 4; k++) row[4 * k + 1] = 0;
    row[17] = 0;
    row[19] = 0;
    header[11] = 1.0;
    return 0;
}
