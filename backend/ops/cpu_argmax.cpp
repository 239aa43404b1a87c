// Row-wise argmax on the CPU, fp32: what every sampled token ends in (greedy rows take
// the argmax of their logits, drawn rows the argmax of p / E). Built by cpu_argmax.py.
//
// torch's CPU argmax keeps one (value, index) pair per row and compares element by
// element: 327-355 us for 32 rows of a 32,000-token vocabulary on this project's 2-core
// VM, two threads (about 6 GB/s each). Here each row is one pass in sixteen lanes, each lane keeping its
// own largest value and where it first saw it (strict >, so the first of equals), and
// the lanes' pairs are merged at the end (the largest, the smaller index among equals):
// the same answer as torch's, the first index of the row's largest value. A NaN counts
// as the largest, as in torch: a row that holds one answers with its first NaN.

#include <cmath>
#include <cstdint>

#include "cpu_threads.h"

namespace {

constexpr int64_t LANES = 16;

int64_t first_nan(const float* x, int64_t V) {
    for (int64_t i = 0; i < V; ++i)
        if (std::isnan(x[i])) return i;
    return -1;
}

int64_t argmax_row(const float* x, int64_t V) {
    if (V < 2 * LANES) {
        int64_t best = 0;
        for (int64_t i = 0; i < V; ++i) {
            if (std::isnan(x[i])) return i;
            if (x[i] > x[best]) best = i;
        }
        return best;
    }
    alignas(64) float value[LANES];
    alignas(64) int32_t index[LANES];
    alignas(64) int32_t nans[LANES];
    for (int64_t l = 0; l < LANES; ++l) {
        value[l] = x[l];
        index[l] = static_cast<int32_t>(l);
        nans[l] = x[l] != x[l];
    }
    int32_t i = LANES;
    const int32_t full = static_cast<int32_t>(V - V % LANES);
    for (; i < full; i += LANES) {
        // (GCC vectorizes this: a compare and selects per lane)
#pragma omp simd
        for (int32_t l = 0; l < LANES; ++l) {
            const float v = x[i + l];
            const bool larger = v > value[l];
            value[l] = larger ? v : value[l];
            index[l] = larger ? i + l : index[l];
            nans[l] |= v != v;
        }
    }
    bool nan = false;
    for (int64_t l = 0; l < LANES; ++l) nan |= nans[l] != 0;
    for (int64_t j = i; j < V; ++j) {   // the tail, into the lane it would have gone to
        const int64_t l = j % LANES;
        nan |= x[j] != x[j];
        if (x[j] > value[l]) { value[l] = x[j]; index[l] = static_cast<int32_t>(j); }
    }
    if (nan) return first_nan(x, V);
    int64_t best = 0;
    for (int64_t l = 1; l < LANES; ++l)
        if (value[l] > value[best] || (value[l] == value[best] && index[l] < index[best])) best = l;
    return index[best];
}

}  // namespace

extern "C" {

// out[r] = argmax of row r of x ([R, V], rows `stride` floats apart), as torch.argmax(x, -1).
// V < 2^31. Rows are split over up to num_threads threads (one started per share and
// call: each share at least 1 << 18 elements).
void argmax_rows_f32(const float* x, int64_t stride, int64_t R, int64_t V, int64_t* out, int64_t num_threads) {
    auto rows = [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) out[r] = argmax_row(x + r * stride, V);
    };
    paged_llm::split_rows(R, std::min<int64_t>(num_threads, R * V / (1 << 18)), rows);
}

}
