// dq_plan_cpu.cpp -- the planner on the CPU (the GPU twin is dq_plan.cu).
#include <math.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "dq_plan_api.h"

extern "C" void dq_cpu_plan(const DqPlanArgs* A, const float* norm2, const float* mean_sum,
                            const float* tail, int8_t* widths, int64_t* order,
                            int64_t* stream_of_sg, double* header) {
    const int64_t m = A->nsg;
    std::vector<uint32_t> keys((size_t)m);
    int64_t n_live = 0;
    int means_ok = 1;
    for (int64_t g = 0; g < m; g++) {
        const uint32_t k = dq_plan_key(norm2[g]);
        const int live = A->zero_class ? k != 0u : 1;
        keys[(size_t)g] = live ? k : 0u;
        n_live += live;
        if (A->centring && !isfinite(mean_sum[g])) means_ok = 0;
    }
    const int64_t base = A->stats_bits + n_live * A->rec_bits[0];
    const double budget = (double)base > A->budget_bits ? A->padded_budget_bits : A->budget_bits;

    double theta = NAN;
    int fixed = -1;
    if (!A->variable) {
        fixed = dq_plan_fixed_class(A, n_live);
    } else {
        std::vector<uint32_t> asc(keys);
        std::sort(asc.begin(), asc.end());
        // The cost falls as theta rises: binary-search the sorted candidates
        // for the smallest one that fits (the GPU tries them all in parallel).
        std::vector<double> cand;
        cand.reserve(3 * (size_t)m);
        for (int64_t i = 0; i < m; i++) {
            const double a = dq_plan_value(asc[(size_t)i]);
            if (a > 0.0) {
                cand.push_back(512.0 * a);
                cand.push_back(17.0 * a);
                if (A->bf16_class) cand.push_back(DQ_PLAN_S16 * a);
            }
        }
        std::sort(cand.begin(), cand.end());
        size_t lo = 0, hi = cand.size();
        while (lo < hi) {
            const size_t mid = lo + ((hi - lo) >> 1);
            if ((double)dq_plan_cost(A, asc.data(), m, base, cand[mid]) <= budget) hi = mid;
            else lo = mid + 1;
        }
        theta = lo < cand.size() ? cand[lo] : INFINITY;
    }

    int64_t counts[DQ_PLAN_CLASSES] = {0, 0, 0, 0, 0};
    std::vector<int8_t> cls((size_t)m);
    for (int64_t g = 0; g < m; g++) {
        const int live = A->zero_class ? dq_plan_key(norm2[g]) != 0u : 1;
        const int c = !live ? 3 : fixed >= 0 ? fixed
                                 : dq_plan_class(dq_plan_value(dq_plan_key(norm2[g])), 1, theta,
                                                 A->bf16_class);
        cls[(size_t)g] = (int8_t)c;
        widths[g] = (int8_t)dq_plan_width_of_class(c);
        counts[c]++;
    }
    int64_t next[DQ_PLAN_CLASSES];
    dq_plan_starts(counts, next);
    for (int64_t g = 0; g < m; g++) {                 // stable: input order within a class
        const int c = cls[(size_t)g];
        const int64_t pos = next[c]++;
        order[pos] = g;
        stream_of_sg[g] = c == 3 ? -1 : pos;
    }
    const int64_t total = dq_plan_total(A, counts);
    header[0] = tail[0];
    header[1] = tail[1];
    header[2] = means_ok;
    header[3] = (double)total > A->budget_bits ? 1.0 : 0.0;
    for (int c = 0; c < 4; c++) header[4 + c] = (double)counts[c];
    header[8] = theta;
    header[9] = (double)total;
    header[10] = (double)counts[4];
    header[11] = 0.0;
    header[12] = 0.0;
}

extern "C" void dq_cpu_plan_pieces(double* header, int64_t n, int64_t T, const int64_t* rb,
                                   int64_t cap, int64_t* table, uint8_t* wire) {
    int64_t counts4[4];
    dq_plan_run_counts(header, counts4);
    DqRuns L;
    dq_runs_init(&L, counts4, rb);
    for (int64_t t = 0; t < n * T; t++) {
        const int64_t bytes = dq_plan_tile_checked(&L, n, T, t, cap, table + t * DQ_TILE_INTS, header);
        if (wire) memset(wire + t * cap + bytes, 0, (size_t)(cap - bytes));
    }
}
