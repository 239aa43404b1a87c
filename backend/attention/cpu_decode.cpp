// Paged attention on the CPU for decode rows (and short prompts' tokens, a row each),
// reading K/V in place from the block pool.
//
// The torch path gathers each decode sequence's blocks into a contiguous copy and runs
// SDPA over it: the copy is written once and read again, and each group of rows costs
// three ops per layer. Here one call per layer walks every row's block table and reads
// each key and value where it lies. Built by cpu_decode.py with g++ at first use; plain
// C ABI (ctypes), no torch headers, so it compiles in about a second.
//
// Layouts (all row-major, innermost stride 1):
//   q, out        [rows of the step, H, D], row strides q_row_stride / out_row_stride
//   key, value    [num_blocks, block_size, KVH, D]
//   block_tables  int32 [*, bt_stride]; row i uses table row seq_idx[i]
// Per row i (the C ABI calls them sequences: num_seqs): its query row rows[i], its length
// lens[i] (a prompt token's: its position + 1); it attends to positions
// [max(0, len - window), len) (window <= 0: all), as the torch path's mask does.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <atomic>
#include <new>
#include <type_traits>
#include <vector>

#include "cpu_attn_tiles.h"
#include "cpu_threads.h"
#include "cpu_vec.h"

namespace {

inline float to_float(float x) { return x; }
inline float to_float(uint16_t bf16) {  // bfloat16 bits: the high half of an fp32
    uint32_t bits = static_cast<uint32_t>(bf16) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
inline void store(float* dst, float x) { *dst = x; }
inline void store(uint16_t* dst, float x) {  // round to nearest even, as torch does
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) { *dst = 0x7fc0; return; }  // NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);
    *dst = static_cast<uint16_t>(bits >> 16);
}

struct Args {
    const void* q; int64_t q_row_stride;
    const void* key; const void* value;
    const int32_t* block_tables; int64_t bt_stride;
    const int64_t* rows; const int64_t* seq_idx; const int64_t* lens;
    int64_t num_seqs, H, KVH, D, block_size, window;
    float scale;
    void* out; int64_t out_row_stride;
    // A tree of proposals (nullptr: none): per row, where its tree's nodes start among the
    // keys and which of them it sees (bit j: node j). Keys from the start on that it does
    // not see weigh exactly 0.
    const int64_t* tree_start; const int64_t* tree_bits;
};

// Where block `id` of a [num_blocks, block_size, KVH, D] pool (a.key or a.value) starts.
template <typename T>
inline const T* block_at(const Args& a, const void* pool, int32_t id) {
    return static_cast<const T*>(pool) + static_cast<int64_t>(id) * a.block_size * a.KVH * a.D;
}

#ifdef PAGED_LLM_X86_VEC
using paged_llm::F32Tiles;
#endif
using paged_llm::exp_nonpositive;
using paged_llm::madd;
using paged_llm::use_f32_tiles;

// q . k for four keys at once: four independent chains of 8-lane accumulators, which
// the compiler turns into vector FMAs (D a multiple of 8). One key at a time waits on
// each FMA's latency and a horizontal sum per key: 2x slower at D = 32. The FMAs are
// written out (madd, here and in the value pass): the libraries build with
// -ffp-contract=off, which keeps the layer ops bit-identical to torch's, and left a
// multiply and an add per element here (the kernel 5-11% slower, benchmarks §16).
template <typename T>
inline void dot4(const float* q, const T* const* k, int64_t D, float* out) {
    float acc[4][8] = {};
    for (int64_t d = 0; d < D; d += 8)
        for (int r = 0; r < 4; ++r) {
#pragma omp simd
            for (int l = 0; l < 8; ++l) acc[r][l] = madd(q[d + l], to_float(k[r][d + l]), acc[r][l]);
        }
    for (int r = 0; r < 4; ++r) {
        float s = 0.f;
        for (int l = 0; l < 8; ++l) s += acc[r][l];
        out[r] = s;
    }
}

template <typename T>
inline float dot(const float* q, const T* k, int64_t D) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < D; ++d) s = madd(q[d], to_float(k[d]), s);
    return s;
}

inline void prefetch_block(const void* p, int64_t bytes) {
    const char* c = static_cast<const char*>(p);
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o);
}

// One sequence, every head, in two passes (scores, then the weighted values) over its
// blocks in table order, in fp32. Each block is read whole and in order, and the next
// one is prefetched: blocks lie anywhere in the pool, and reading one head's slice per
// pass (a strided quarter of each block) ran at DRAM latency, slower than torch's
// gather of whole blocks once the pool outgrew the cache.
// DC: the head size where it is known at compile time (32, 64, 128, 256), else 0; with
// fp32 on x86 the inner loops are then the vector tiles of cpu_attn_tiles.h (eight keys
// at a time), and the generic ones below take the rest of each block.
template <typename T, int DC>
void attend_one(const Args& a, int64_t i, const char* next_seq, std::vector<float>& scratch) {
    const int64_t H = a.H, KVH = a.KVH, g = H / KVH, D = DC > 0 ? DC : a.D, bs = a.block_size;
    const int64_t len = a.lens[i];
    const int64_t start = a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0;
    const int64_t n = len - start;
    const T* q = static_cast<const T*>(a.q) + a.rows[i] * a.q_row_stride;
    T* out = static_cast<T*>(a.out) + a.rows[i] * a.out_row_stride;
    const int32_t* table = a.block_tables + a.seq_idx[i] * a.bt_stride;
    const int64_t row = KVH * D;                       // one token's keys (or values), all heads
    const int64_t block_bytes = bs * row * static_cast<int64_t>(sizeof(T));
    scratch.resize(static_cast<size_t>(H * D * 2 + H * n));
    float* qf = scratch.data();             // [H, D] queries, scaled
    float* acc = qf + H * D;                // [H, D] weighted values
    float* scores = acc + H * D;            // [H, n]
    for (int64_t j = 0; j < H * D; ++j) { qf[j] = to_float(q[j]) * a.scale; acc[j] = 0.f; }
    const bool by4 = D % 8 == 0;
    const int64_t first = start - start % bs;
    for (int pass = 0; pass < 2; ++pass) {
        const void* pool = pass == 0 ? a.key : a.value;
        for (int64_t t0 = first; t0 < len; t0 += bs) {
            const T* block = block_at<T>(a, pool, table[t0 / bs]);
            // The next block, a token's row at a time as this one's rows are read: spread
            // out, the requests stay within what the core can have in flight.
            // After the last key block comes the first value block; after the last value
            // block, the next sequence's first key block (`next_seq`, none past the range).
            const char* next = t0 + bs < len ? reinterpret_cast<const char*>(block_at<T>(a, pool, table[t0 / bs + 1]))
                : pass == 0 ? reinterpret_cast<const char*>(block_at<T>(a, a.value, table[first / bs]))
                : next_seq;
            const int64_t row_bytes = block_bytes / bs;
            int64_t t = std::max(t0, start);
            if (next) prefetch_block(next, (t - t0) * row_bytes);           // rows this block skips
            auto ahead = [&](int64_t tt, int64_t count) {
                if (next) prefetch_block(next + (tt - t0) * row_bytes, count * row_bytes);
            };
            const int64_t t_end = std::min(t0 + bs, len);
#ifdef PAGED_LLM_X86_VEC
            if constexpr (use_f32_tiles<T, DC>()) {
                if (pass == 0) {
                    for (; t + 8 <= t_end; t += 8) {   // the rest (under eight) as below
                        ahead(t, 8);
                        F32Tiles<DC>::scores8(qf, reinterpret_cast<const float*>(block + (t - t0) * row), row, H, g,
                                              scores + (t - start), n);
                    }
                } else {
                    while (t < t_end) {
                        const int64_t m = std::min<int64_t>(8, t_end - t);
                        ahead(t, m);
                        const float* v0 = reinterpret_cast<const float*>(block + (t - t0) * row);
                        for (int64_t j = 0; j < H; ++j)
                            F32Tiles<DC>::values(scores + j * n + (t - start), v0 + (j / g) * D, row, m, acc + j * D);
                        t += m;
                    }
                }
            }
#endif
            if (pass == 0) {
                for (; by4 && t + 4 <= t_end; t += 4) {
                    ahead(t, 4);
                    const T* k0 = block + (t - t0) * row;
                    for (int64_t h = 0; h < KVH; ++h) {
                        const T* k[4] = {k0 + h * D, k0 + row + h * D, k0 + 2 * row + h * D, k0 + 3 * row + h * D};
                        for (int64_t j = h * g; j < (h + 1) * g; ++j) dot4(qf + j * D, k, D, scores + j * n + (t - start));
                    }
                }
                for (; t < t_end; ++t) {
                    ahead(t, 1);
                    const T* k = block + (t - t0) * row;
                    for (int64_t j = 0; j < H; ++j) scores[j * n + (t - start)] = dot(qf + j * D, k + (j / g) * D, D);
                }
            } else {
                // Four keys at a time: one load-add-store of the accumulator per four keys,
                // not per key (its chain through memory is this pass's latency).
                for (; t + 4 <= t_end; t += 4) {
                    ahead(t, 4);
                    const T* v0 = block + (t - t0) * row;
                    for (int64_t j = 0; j < H; ++j) {
                        const T* v = v0 + (j / g) * D;
                        const float* p = scores + j * n + (t - start);
                        const float p0 = p[0], p1 = p[1], p2 = p[2], p3 = p[3];
                        float* __restrict__ accj = acc + j * D;
#pragma omp simd
                        for (int64_t d = 0; d < D; ++d)
                            accj[d] = madd(p3, to_float(v[3 * row + d]), madd(p2, to_float(v[2 * row + d]),
                                      madd(p1, to_float(v[row + d]), madd(p0, to_float(v[d]), accj[d]))));
                    }
                }
                for (; t < t_end; ++t) {
                    ahead(t, 1);
                    const T* v = block + (t - t0) * row;
                    for (int64_t j = 0; j < H; ++j) {
                        const float p = scores[j * n + (t - start)];
                        float* __restrict__ accj = acc + j * D;
                        const T* vj = v + (j / g) * D;
#pragma omp simd
                        for (int64_t d = 0; d < D; ++d) accj[d] = madd(p, to_float(vj[d]), accj[d]);
                    }
                }
            }
        }
        const int64_t tree_from = a.tree_start ? std::max(a.tree_start[i], start) : len;
        auto hidden = [&](int64_t t) { return !((a.tree_bits[i] >> (t - a.tree_start[i])) & 1); };
        if (pass == 0) {   // the softmax of each head's scores, in place
            for (int64_t t = tree_from; t < len; ++t)       // (a tree's nodes off its path: out)
                if (hidden(t))
                    for (int64_t j = 0; j < H; ++j) scores[j * n + (t - start)] = -INFINITY;
            for (int64_t j = 0; j < H; ++j) {
                float* sj = scores + j * n;
                float m = -INFINITY;
#pragma omp simd reduction(max : m)
                for (int64_t t = 0; t < n; ++t) m = std::max(m, sj[t]);
                float sum = 0.f;
#pragma omp simd reduction(+ : sum)
                for (int64_t t = 0; t < n; ++t) { sj[t] = exp_nonpositive(sj[t] - m); sum += sj[t]; }
                const float inv = 1.f / sum;
#pragma omp simd
                for (int64_t t = 0; t < n; ++t) sj[t] *= inv;
            }
            for (int64_t t = tree_from; t < len; ++t)       // (exp's clamp left them at 1e-38)
                if (hidden(t))
                    for (int64_t j = 0; j < H; ++j) scores[j * n + (t - start)] = 0.f;
        }
    }
    for (int64_t j = 0; j < H * D; ++j) store(out + j, acc[j]);
}

// Where sequence i's first key block (the one its window starts in) lies.
template <typename T>
const char* first_key_block(const Args& a, int64_t i) {
    const int64_t start = a.window > 0 ? std::max<int64_t>(0, a.lens[i] - a.window) : 0;
    return reinterpret_cast<const char*>(
        block_at<T>(a, a.key, a.block_tables[a.seq_idx[i] * a.bt_stride + start / a.block_size]));
}

template <typename T, int DC>
void run(const Args& a, int64_t num_threads) {
    const int64_t items = a.num_seqs;
    // The threads take items (a sequence's decode row, or a prompt token's row) one at a
    // time from a shared counter, so that none waits for a slower one's fixed share (a
    // helper starts tens of microseconds late), and a thread that cannot start leaves
    // its items to the others. (An error inside one, an allocation, stops the others
    // after their current items, and the call returns an error code.) (On the 2-core VM
    // it ran as fast as the split by keys it replaced: within 1% quiet, within the runs'
    // spread with a core taken.) Each item is one thread's whole: the results do not
    // depend on who took it. A thread takes its next item before working on the current
    // one, to prefetch the next one's first key block meanwhile.
    std::atomic<int64_t> counter{0};
    std::atomic<bool> failed{false};
    auto work = [&]() {
        try {   // (an exception must not leave a thread: it would terminate the process)
            std::vector<float> scratch;
            int64_t i = counter.fetch_add(1, std::memory_order_relaxed);
            while (i < items) {
                const int64_t next = counter.fetch_add(1, std::memory_order_relaxed);
                attend_one<T, DC>(a, i, next < items ? first_key_block<T>(a, next) : nullptr, scratch);
                i = next;
            }
        } catch (...) {
            failed = true;
            counter = items;    // the others stop after their current item
        }
    };
    // A thread is started per call (tens of microseconds): only for at least
    // MIN_KEYS_PER_THREAD keys a thread (a few hundred microseconds of work).
    constexpr int64_t MIN_KEYS_PER_THREAD = 2048;
    int64_t keys = 0;
    for (int64_t i = 0; i < items; ++i) keys += a.lens[i] + 16;
    num_threads = std::min(num_threads, keys / MIN_KEYS_PER_THREAD);
    paged_llm::on_threads(items > 1 ? num_threads : 1, work);
    if (failed) throw std::bad_alloc();
}

// f(std::integral_constant<int, DC>) for the head sizes compiled for (DC = D: the fp32
// tiles need it at compile time), DC = 0 for any other.
template <typename F>
auto with_head_size(int64_t D, F&& f) {
    switch (D) {
    case 32: return f(std::integral_constant<int, 32>{});
    case 64: return f(std::integral_constant<int, 64>{});
    case 128: return f(std::integral_constant<int, 128>{});
    case 256: return f(std::integral_constant<int, 256>{});
    default: return f(std::integral_constant<int, 0>{});
    }
}

}  // namespace

extern "C" {

// Whether fp32 at head size D runs the vector tiles (cpu_attn_tiles.h) in this build: the
// tests say which loops they checked.
int f32_tiles(int64_t D) {
    return with_head_size(D, [](auto dc) { return static_cast<int>(use_f32_tiles<float, decltype(dc)::value>()); });
}

// The step's K/V rows into the pool: row t of key/value ([T, KVH, D], row strides in
// bytes, each row's KVH * D values contiguous) to slot slots[t] of the caches
// (num_slots rows of row_bytes). One call where the torch path is six ops (views, casts,
// two index copies). slots: int32 (slot_bytes 4) or int64 (8). Returns 1, writing
// nothing, for a slot outside the pool.
int write_kv(const void* slots, int64_t slot_bytes, int64_t T, const char* key, int64_t k_stride,
             const char* value, int64_t v_stride, int64_t row_bytes, char* k_cache, char* v_cache,
             int64_t num_slots) {
    auto slot = [&](int64_t t) -> int64_t {
        return slot_bytes == 4 ? static_cast<const int32_t*>(slots)[t] : static_cast<const int64_t*>(slots)[t];
    };
    for (int64_t t = 0; t < T; ++t)
        if (slot(t) < 0 || slot(t) >= num_slots) return 1;
    for (int64_t t = 0; t < T; ++t) {
        std::memcpy(k_cache + slot(t) * row_bytes, key + t * k_stride, static_cast<size_t>(row_bytes));
        std::memcpy(v_cache + slot(t) * row_bytes, value + t * v_stride, static_cast<size_t>(row_bytes));
    }
    return 0;
}

// dtype: 0 float32, 1 bfloat16 (q, key, value and out alike).
// Returns 4, reading no K/V, when a sequence needs more blocks than its table row holds
// (table_width) or its table names a block outside the pool (num_blocks): the kernel
// reads where the table points, so a bad table must be an error, not a stray read.
int paged_decode(int dtype, const void* q, int64_t q_row_stride, const void* key, const void* value,
                 const int32_t* block_tables, int64_t bt_stride, const int64_t* rows,
                 const int64_t* seq_idx, const int64_t* lens, int64_t num_seqs, int64_t H,
                 int64_t KVH, int64_t D, int64_t block_size, int64_t window, float scale,
                 void* out, int64_t out_row_stride, int64_t num_threads, int64_t table_width,
                 int64_t num_blocks, const int64_t* tree_start, const int64_t* tree_bits) {
    if (KVH <= 0 || H % KVH != 0 || D <= 0 || block_size <= 0) return 1;
    // (A prompt's rows come together and share their table: its entries are checked once,
    // not once per row.)
    int64_t checked_row = -1, checked = 0;   // table row, and how many of its entries are checked
    for (int64_t i = 0; i < num_seqs; ++i) {
        const int64_t needed = (lens[i] + block_size - 1) / block_size;
        if (lens[i] < 1 || needed > table_width) return 4;
        if (seq_idx[i] != checked_row) checked_row = seq_idx[i], checked = 0;
        const int32_t* table = block_tables + seq_idx[i] * bt_stride;
        for (int64_t b = checked; b < needed; ++b)
            if (table[b] < 0 || table[b] >= num_blocks) return 4;
        checked = std::max(checked, needed);
    }
    const Args a{q, q_row_stride, key, value, block_tables, bt_stride, rows, seq_idx, lens,
                 num_seqs, H, KVH, D, block_size, window, scale, out, out_row_stride, tree_start, tree_bits};
    // Nothing may unwind through the C ABI (that would terminate the process): a failed
    // allocation or thread start becomes an error code, and the caller raises.
    try {
        if (dtype == 0) {
            with_head_size(D, [&](auto dc) { run<float, decltype(dc)::value>(a, num_threads); });
        } else if (dtype == 1) {
            run<uint16_t, 0>(a, num_threads);
        } else {
            return 2;
        }
    } catch (...) {
        return 3;
    }
    return 0;
}

}
