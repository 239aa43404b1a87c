// The CPU decode-attention kernel's fp32 inner loops (backend/attention/cpu_decode.cpp) in
// x86 vectors: scores of eight keys at a time, and the weighted values into accumulators
// held in registers. Where neither AVX2 nor AVX-512 is there, use_f32_tiles() is false and
// the kernel keeps its generic loops. cpu_build.py hashes this file into the key.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cpu_vec_x86.h"

namespace paged_llm {

#ifdef PAGED_LLM_X86_VEC
// The fp32 path's inner loops in x86 vectors, for a head size D known at compile time
// (a multiple of the vector width). Written out because its generic loops left a
// horizontal sum per key and head (its adds in series: no reassociation without
// -ffast-math) and their accumulators on the stack.
template <int D>
struct F32Tiles {
    static constexpr int NV = D / Vec::W;            // vectors per head
    static_assert(NV > 0 && D % Vec::W == 0, "D: a multiple of the vector width");

    // scores[j * n + r] = q_j . k_r for the eight keys k_r = k0 + r * row and every query
    // head j (of kv head j / g): eight independent FMA chains per head, one transposing
    // sum for the eight scores. The query's vectors one at a time (loaded once for the
    // eight keys): ten registers at any head size, within AVX2's sixteen.
    static void scores8(const float* qf, const float* k0, int64_t row, int64_t H, int64_t g, float* scores,
                        int64_t n) {
        for (int64_t j = 0; j < H; ++j) {
            const float* kj = k0 + (j / g) * D;
            const float* qj = qf + j * D;
            Vec::V acc[8];
            const Vec::V q0 = Vec::load(qj);
            for (int r = 0; r < 8; ++r) acc[r] = Vec::mul(q0, Vec::load(kj + r * row));
            for (int x = 1; x < NV; ++x) {
                const Vec::V qx = Vec::load(qj + x * Vec::W);
                for (int r = 0; r < 8; ++r) acc[r] = Vec::fma(qx, Vec::load(kj + r * row + x * Vec::W), acc[r]);
            }
            Vec::sum8(acc, scores + j * n);
        }
    }

    // Chunks of the accumulator held in registers: two sets of CH (even and odd keys, for
    // twice the independent chains), a quarter of the registers each at most.
    static constexpr int CH = NV < Vec::REGS / 4 ? NV : Vec::REGS / 4;
    static_assert(NV % CH == 0, "CH divides NV");

    // acc[0..D) += sum over r < m of p[r] * v_r, v_r = v0 + r * row.
    static void values(const float* p, const float* v0, int64_t row, int64_t m, float* acc) {
        for (int c = 0; c < NV; c += CH) {
            Vec::V a0[CH], a1[CH];
            for (int x = 0; x < CH; ++x) { a0[x] = Vec::load(acc + (c + x) * Vec::W); a1[x] = Vec::zero(); }
            int64_t r = 0;
            for (; r + 2 <= m; r += 2) {
                const Vec::V p0 = Vec::set1(p[r]), p1 = Vec::set1(p[r + 1]);
                const float* v = v0 + r * row + c * Vec::W;
                for (int x = 0; x < CH; ++x) {
                    a0[x] = Vec::fma(p0, Vec::load(v + x * Vec::W), a0[x]);
                    a1[x] = Vec::fma(p1, Vec::load(v + row + x * Vec::W), a1[x]);
                }
            }
            if (r < m) {
                const Vec::V p0 = Vec::set1(p[r]);
                const float* v = v0 + r * row + c * Vec::W;
                for (int x = 0; x < CH; ++x) a0[x] = Vec::fma(p0, Vec::load(v + x * Vec::W), a0[x]);
            }
            for (int x = 0; x < CH; ++x) Vec::store(acc + (c + x) * Vec::W, Vec::add(a0[x], a1[x]));
        }
    }
};
#endif

// Whether attend_one<T, DC> takes the vector tiles above: fp32, a compile-time head size
// that is a multiple of the vector width, on x86 with AVX2 or AVX-512.
template <typename T, int DC>
constexpr bool use_f32_tiles() {
#ifdef PAGED_LLM_X86_VEC
    return std::is_same<T, float>::value && DC > 0 && DC % Vec::W == 0;
#else
    return false;
#endif
}

}  // namespace paged_llm
