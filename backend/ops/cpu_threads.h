// Work over threads started per call: our C++ kernels' one way to run in parallel
// (cpu_decode.cpp's attention, cpu_layer_ops.cpp's SiLU-and-mul, cpu_argmax.cpp). A
// thread costs tens of microseconds to start, so callers ask for threads only for
// enough work.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace paged_llm {

// work() on this thread and on up to num_threads - 1 started ones, all joined before
// this returns. work takes its items from a shared counter, so a thread that cannot
// start (no exception may leave through the kernels' C ABI) leaves its items to the
// others. work must not throw.
template <typename F>
void on_threads(int64_t num_threads, F&& work) {
    std::vector<std::thread> threads;
    try {
        threads.reserve(static_cast<size_t>(std::max<int64_t>(num_threads - 1, 0)));
        for (int64_t p = 1; p < num_threads; ++p) threads.emplace_back(work);   // (reserved: no reallocation)
    } catch (...) {
        // fewer threads: the started ones are joined below
    }
    work();
    for (auto& t : threads) t.join();
}

// rows(begin, end) over [0, R) in up to `shares` contiguous shares, taken by up to
// `shares` threads. rows must not throw.
template <typename F>
void split_rows(int64_t R, int64_t shares, F&& rows) {
    shares = std::max<int64_t>(1, std::min(shares, R));
    std::atomic<int64_t> counter{0};
    on_threads(shares, [&]() {
        for (int64_t p = counter++; p < shares; p = counter++) rows(R * p / shares, R * (p + 1) / shares);
    });
}

}  // namespace paged_llm
