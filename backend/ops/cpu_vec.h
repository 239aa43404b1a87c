// Element-wise helpers the CPU libraries share (cpu_decode.cpp, cpu_layer_ops.cpp), in
// forms the compiler vectorizes under `#pragma omp simd` (-fopenmp-simd). cpu_build.py
// puts this folder on the include path and hashes this file into each library's key.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace paged_llm {

// 2^n for an integer-valued n in [-126, 127]: n set in the exponent bits.
inline float pow2i(float n) {
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return scale;
}

// 2^t for t in [-126, 127) in a form the compiler vectorizes (libm's expf is a call per
// element): an integer power set in the exponent bits, and 2^f for f in [0, 1) by a
// degree-6 polynomial (relative error about 2e-7, as expf's few ulp).
inline float exp2_poly(float t) {
    const float fi = std::floor(t);
    const float f = t - fi;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    return p * pow2i(fi);
}

// exp(x) for x <= 0 (softmax's shifted scores).
inline float exp_nonpositive(float x) { return exp2_poly(std::max(x, -87.0f) * 1.44269504088896341f); }

// exp(x) for any x, clamped to [-87, 88] (exp(88) = 1.65e38: no overflow to inf), within
// a few ulp over the whole range: x = n ln2 + r with ln2 in two parts (Cody-Waite: n ln2_hi
// is exact, so r keeps its bits at large |x|, where exp2_poly's reduction loses them),
// |r| <= ln2 / 2, and exp(r) by its Taylor series to r^7 (truncation below 2e-8).
inline float exp_bounded(float x) {
    x = std::min(std::max(x, -87.0f), 88.0f);
    const float n = std::floor(x * 1.44269504088896341f + 0.5f);
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return p * pow2i(n);
}

// a * b + c, fused where the CPU has FMA (FP_FAST_FMAF: the build's -march=native found
// it). Without it std::fma is a libm call per element, which the compiler cannot vectorize.
inline float madd(float a, float b, float c) {
#ifdef FP_FAST_FMAF
    return std::fma(a, b, c);
#else
    return a * b + c;
#endif
}

}  // namespace paged_llm
