// fp32 vectors in x86 intrinsics, for loops the compiler does not vectorize well by itself:
// AVX-512 where the build's CPU has it (-march=native), else AVX2 with FMA. Defines
// PAGED_LLM_X86_VEC where one of them is there; elsewhere (Arm, older x86) callers keep
// their generic loops. cpu_build.py hashes this file into each library's cache key.
#pragma once

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define PAGED_LLM_X86_VEC 1

namespace paged_llm {

struct Vec {
#if defined(__AVX512F__)
    using V = __m512;
    static constexpr int W = 16;       // lanes
    static constexpr int REGS = 32;    // vector registers
    static V load(const float* p) { return _mm512_loadu_ps(p); }
    static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
    static V zero() { return _mm512_setzero_ps(); }
    static V set1(float x) { return _mm512_set1_ps(x); }
    static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
    static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
    static V add(V a, V b) { return _mm512_add_ps(a, b); }
    // Lanes 0-7 plus lanes 8-15.
    static __m256 fold8(V v) {
        return _mm256_add_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    }
#else
    using V = __m256;
    static constexpr int W = 8;
    static constexpr int REGS = 16;
    static V load(const float* p) { return _mm256_loadu_ps(p); }
    static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
    static V zero() { return _mm256_setzero_ps(); }
    static V set1(float x) { return _mm256_set1_ps(x); }
    static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
    static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
    static V add(V a, V b) { return _mm256_add_ps(a, b); }
    static __m256 fold8(V v) { return v; }
#endif

    // The sums of eight vectors' lanes, written to out[0..8): each folded to 8 lanes, then
    // transposed by pairwise adds (six hadds and a lane swap for all eight, where a
    // horizontal sum per vector costs about three times the shuffles).
    static void sum8(const V* a, float* out) {
        const __m256 t0 = _mm256_hadd_ps(fold8(a[0]), fold8(a[1]));
        const __m256 t1 = _mm256_hadd_ps(fold8(a[2]), fold8(a[3]));
        const __m256 t2 = _mm256_hadd_ps(fold8(a[4]), fold8(a[5]));
        const __m256 t3 = _mm256_hadd_ps(fold8(a[6]), fold8(a[7]));
        const __m256 u0 = _mm256_hadd_ps(t0, t1);   // sums of a0..a3: low 128-bit lane, then high
        const __m256 u1 = _mm256_hadd_ps(t2, t3);   // a4..a7
        _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                            _mm256_permute2f128_ps(u0, u1, 0x31)));
    }
};

}  // namespace paged_llm

#endif
