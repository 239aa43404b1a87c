// Fused layer ops on the CPU, fp32: residual-add + RMSNorm, rotary (rotate-half) and
// SiLU-and-mul.
// Each is one call where the torch references (reference.py) are 7 and 20 small ops, and each op holds the GIL for its dispatch: with the forward split over
// threads (cpu_shards.py) the threads queue for it. Built by cpu_layer_ops.py.
//
// The same arithmetic as the references, operation for operation: separate roundings for
// each multiply and add (ISO mode, -std=c++17: no contraction into FMAs), so rotary and
// the residual add are bit-identical; RMSNorm's mean of squares is summed in double (the
// reference sums floats in its own order: the two can differ in the last bit).

#include <cmath>
#include <cstdint>

#include "cpu_threads.h"
#include "cpu_vec.h"

extern "C" {

// out[t] = weight * (h * 1/sqrt(mean(h^2) + eps)), h = x[t] + residual[t] (or x[t] when
// residual is null), written to res_out[t] when residual is given. Rows are N floats at
// the given strides (in floats).
void add_rms_norm_f32(const float* x, int64_t x_stride, const float* residual, int64_t r_stride,
                      const float* weight, int64_t T, int64_t N, float eps, float* out, int64_t out_stride,
                      float* res_out, int64_t res_stride) {
    for (int64_t t = 0; t < T; ++t) {
        const float* xt = x + t * x_stride;
        float* ot = out + t * out_stride;
        const float* h = xt;
        if (residual) {
            const float* rt = residual + t * r_stride;
            float* ht = res_out + t * res_stride;
#pragma omp simd
            for (int64_t i = 0; i < N; ++i) ht[i] = xt[i] + rt[i];
            h = ht;
        }
        double sum = 0.0;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < N; ++i) sum += static_cast<double>(h[i]) * h[i];
        const float mean = static_cast<float>(sum / static_cast<double>(N));
        const float r = 1.0f / std::sqrt(mean + eps);
#pragma omp simd
        for (int64_t i = 0; i < N; ++i) ot[i] = weight[i] * (h[i] * r);
    }
}

}

namespace {

// Rotate-half RoPE of one tensor's heads, [T, heads, D] at row stride `row_stride`
// (heads D apart), into `out` [T, heads, D] contiguous.
template <typename P>
void rotate(const P* positions, const float* x, int64_t row_stride, int64_t heads, int64_t D,
            const float* cos_cache, const float* sin_cache, int64_t T, float* out) {
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; ++t) {
        const float* c = cos_cache + static_cast<int64_t>(positions[t]) * D;
        const float* s = sin_cache + static_cast<int64_t>(positions[t]) * D;
        for (int64_t h = 0; h < heads; ++h) {
            const float* xh = x + t * row_stride + h * D;
            float* oh = out + (t * heads + h) * D;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float a = xh[i] * c[i];
                const float b = -xh[i + half] * s[i];
                oh[i] = a + b;
            }
#pragma omp simd
            for (int64_t i = half; i < D; ++i) {
                const float a = xh[i] * c[i];
                const float b = xh[i - half] * s[i];
                oh[i] = a + b;
            }
        }
    }
}

// Returns 1, writing nothing, when a position lies outside the tables' num_positions rows.
template <typename P>
int rotary(const P* positions, int64_t T, const float* q, int64_t q_stride, int64_t H, const float* k,
           int64_t k_stride, int64_t KVH, int64_t D, const float* cos_cache, const float* sin_cache,
           int64_t num_positions, float* q_out, float* k_out) {
    for (int64_t t = 0; t < T; ++t)
        if (positions[t] < 0 || static_cast<int64_t>(positions[t]) >= num_positions) return 1;
    rotate(positions, q, q_stride, H, D, cos_cache, sin_cache, T, q_out);
    rotate(positions, k, k_stride, KVH, D, cos_cache, sin_cache, T, k_out);
    return 0;
}

}  // namespace

extern "C" {

// q [T, H, D] and k [T, KVH, D] (row strides in floats; heads D apart) rotated into
// q_out and k_out (contiguous): x * cos + rotate_half(x) * sin, rotate_half(x) =
// [-x2, x1], cos/sin rows of D values at each token's position (the reference's
// arithmetic, each product and sum rounded on its own). positions: int32
// (position_bytes 4) or int64 (8). Returns 1 for a position outside the tables.
int rotary_f32(const void* positions, int64_t position_bytes, int64_t T, const float* q, int64_t q_stride,
               int64_t H, const float* k, int64_t k_stride, int64_t KVH, int64_t D, const float* cos_cache,
               const float* sin_cache, int64_t num_positions, float* q_out, float* k_out) {
    if (position_bytes == 4)
        return rotary(static_cast<const int32_t*>(positions), T, q, q_stride, H, k, k_stride, KVH, D, cos_cache,
                      sin_cache, num_positions, q_out, k_out);
    return rotary(static_cast<const int64_t*>(positions), T, q, q_stride, H, k, k_stride, KVH, D, cos_cache,
                  sin_cache, num_positions, q_out, k_out);
}

// out[t] = silu(gate[t]) * up[t] with x[t] = [gate | up] (2I floats at row stride
// x_stride), out [T, I] contiguous: one pass where torch makes two (silu, then the
// product) and a temporary. silu(g) = g / (1 + exp(-g)) as torch writes it, with our
// vectorized exp (cpu_vec.h): not bit-identical to torch's (its exp differs in the last
// bits; below g = -87 ours gives a tiny negative where torch's exp overflows to -0).
// Rows are split over up to num_threads threads (one started per share and call: each
// share at least 1 << 18 elements, so a decode step's few rows stay on this thread).
void silu_and_mul_f32(const float* x, int64_t x_stride, int64_t T, int64_t I, float* out, int64_t num_threads) {
    // In chunks, the denominators first: written as one loop (o = g / (1 + exp(-g)) * u),
    // GCC 12 vectorized it with a second, masked division and a blend per vector, 4.6x
    // slower (1.23 against 0.27 ns an element, one thread); same values.
    auto rows = [&](int64_t begin, int64_t end) {
        constexpr int64_t CHUNK = 512;
        float den[CHUNK];
        for (int64_t t = begin; t < end; ++t) {
            const float* g = x + t * x_stride;
            const float* u = g + I;
            float* o = out + t * I;
            for (int64_t i0 = 0; i0 < I; i0 += CHUNK) {
                const int64_t m = std::min(CHUNK, I - i0);
#pragma omp simd
                for (int64_t i = 0; i < m; ++i) den[i] = 1.0f + paged_llm::exp_bounded(-g[i0 + i]);
#pragma omp simd
                for (int64_t i = 0; i < m; ++i) o[i0 + i] = g[i0 + i] / den[i] * u[i0 + i];
            }
        }
    };
    paged_llm::split_rows(T, std::min<int64_t>(num_threads, T * I / (1 << 18)), rows);
}

}
