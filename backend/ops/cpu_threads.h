// Rows split over threads started per call: the simple kernels' one way to run in
// parallel (cpu_layer_ops.cpp's SiLU-and-mul, cpu_argmax.cpp). A thread costs tens of
// microseconds to start, so callers ask for shares only for enough work.
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace paged_llm {

// rows(begin, end) over [0, R) in up to `shares` contiguous shares, the last on this
// thread. A share whose thread cannot start runs on this thread too: no exception may
// leave through the kernels' C ABI. rows must not throw.
template <typename F>
void split_rows(int64_t R, int64_t shares, F&& rows) {
    shares = std::max<int64_t>(1, std::min(shares, R));
    std::vector<std::thread> threads;
    try {
        threads.reserve(static_cast<size_t>(shares));
    } catch (...) {
        rows(0, R);
        return;
    }
    for (int64_t p = 0; p + 1 < shares; ++p) {
        const int64_t begin = R * p / shares, end = R * (p + 1) / shares;
        try {
            threads.emplace_back(rows, begin, end);   // (reserved: no reallocation)
        } catch (...) {   // no thread: this one does the share (the started ones are joined below)
            rows(begin, end);
        }
    }
    rows(R * (shares - 1) / shares, R);
    for (auto& t : threads) t.join();
}

}  // namespace paged_llm
