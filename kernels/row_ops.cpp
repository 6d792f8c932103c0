// Small per-row CPU kernels of a decode step's edges (kernels/row_ops.py): the embedding rows of a GGUF table
// dequantized, the greedy argmax of the logits rows, and a quantized linear layer's bias added to its output rows.
//
// Both replace torch / numpy code whose per-call overhead was most of their cost at batch 1: the `gguf` package's
// numpy dequantizer took ~15 us for one 576-wide row, torch's argmax ~28 us over a 49,152-wide row. Every function
// returns 0, or a negative status for arguments it does not take (the Python side then keeps its own code).
//
// Dequantization gives the `gguf` package's bits: each value is d * q (Q8_0, Q4_0) or d * q + m (Q4_1), computed in
// float32 in that order with no fused multiply-add (the build's -std=c++17 turns contraction off; the tests compare
// bit for bit).

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int QK = 32;  // values per block of the types below
constexpr int Q4_0 = 2, Q4_1 = 3, Q8_0 = 8;  // ggml's type ids

float half_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
    uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);  // inf, NaN
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;  // signed zero
    } else {  // subnormal: normalise
        exponent = 113;
        while ((mantissa & 0x400) == 0) {
            mantissa <<= 1;
            --exponent;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
    }
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

float read_half(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, sizeof h);
    return half_to_float(h);
}

int block_bytes(int qtype) {
    switch (qtype) {
        case Q4_0: return 2 + QK / 2;
        case Q4_1: return 4 + QK / 2;
        case Q8_0: return 2 + QK;
        default: return -1;
    }
}

void dequantize_block(int qtype, const uint8_t* block, float* out) {
    const float d = read_half(block);
    if (qtype == Q8_0) {
        const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
        for (int i = 0; i < QK; ++i) out[i] = static_cast<float>(q[i]) * d;
        return;
    }
    const uint8_t* q = block + (qtype == Q4_1 ? 4 : 2);
    if (qtype == Q4_0) {  // low nibbles are values 0..15, high nibbles 16..31
        for (int i = 0; i < QK / 2; ++i) {
            out[i] = d * static_cast<float>((q[i] & 0x0F) - 8);
            out[i + QK / 2] = d * static_cast<float>((q[i] >> 4) - 8);
        }
        return;
    }
    const float m = read_half(block + 2);
    for (int i = 0; i < QK / 2; ++i) {
        const float lo = d * static_cast<float>(q[i] & 0x0F), hi = d * static_cast<float>(q[i] >> 4);
        out[i] = lo + m;
        out[i + QK / 2] = hi + m;
    }
}

// The index of the first NaN, else of the first maximum (torch.argmax's answer), of x[0, n).
int64_t argmax_row(const float* x, int64_t n) {
    int64_t i = 0;
    float best = -INFINITY;
    bool has_nan = false;
#if defined(__AVX2__)
    __m256 vmax = _mm256_set1_ps(-INFINITY), vnan = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        vmax = _mm256_max_ps(vmax, v);
    }
    has_nan = _mm256_movemask_ps(vnan) != 0;
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    for (float lane : lanes) best = lane > best ? lane : best;
#endif
    for (; i < n; ++i) {
        has_nan = has_nan || std::isnan(x[i]);
        best = x[i] > best ? x[i] : best;
    }
    for (int64_t j = 0; j < n; ++j) {
        if (has_nan ? std::isnan(x[j]) : x[j] == best) return j;
    }
    return 0;  // n == 0 is refused by the caller
}

float bf16_to_float(uint16_t h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

uint16_t float_to_bf16(float f) {  // round to nearest even, NaN kept quiet: torch's conversion
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return static_cast<uint16_t>(bits >> 16);
}

// ---------------------------------------------------------------- the sampler's exponential race (tm_race_rows)
// A sampled row's token is argmax_v p_v / q_v with q_v ~ Exp(1) (workers/sampler.py), i.e. argmax_v s_v - log q_v for
// its scaled logits s (the softmax's normalisation does not move the argmax). Here q_v = -log u_v, with u_v drawn
// from a counter-based hash of (the row's 64-bit key, v): no noise tensor, no softmax, and a row's draws depend on its
// key alone, so a seeded request's tokens do not depend on its batch. torch's uniform_ + log1p + softmax + divide
// took ~1.5 ms a step for two rows of a 49k vocabulary on one thread; this pass, ~0.4 (two dependent logs a token).

// Chris Wellons' lowbias32: a bijective 32-bit mixer with good avalanche, on 32-bit lanes (vectorizes on AVX2).
inline uint32_t lowbias32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    x ^= x >> 16;
    return x;
}

// Natural log of a positive normal float (Cephes' logf: within ~2 ulp), branch-free so the loops calling it vectorize.
inline float log_positive(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    float e = static_cast<float>(static_cast<int32_t>(bits >> 23) - 126);
    const uint32_t mantissa_bits = (bits & 0x007FFFFFu) | 0x3F000000u;  // m in [0.5, 1)
    float m;
    std::memcpy(&m, &mantissa_bits, sizeof m);
    const bool small = m < 0.707106781186547524f;
    e = small ? e - 1.0f : e;
    m = small ? m + m - 1.0f : m - 1.0f;
    const float z = m * m;
    float y = 7.0376836292e-2f;
    y = y * m - 1.1514610310e-1f;
    y = y * m + 1.1676998740e-1f;
    y = y * m - 1.2420140846e-1f;
    y = y * m + 1.4249322787e-1f;
    y = y * m - 1.6668057665e-1f;
    y = y * m + 2.0000714765e-1f;
    y = y * m - 2.4999993993e-1f;
    y = y * m + 3.3333331174e-1f;
    y = y * m * z;
    y += -2.12194440e-4f * e;
    y += -0.5f * z;
    return m + y + 0.693359375f * e;
}

// s_v - log q_v for v in [begin, begin + n): u = (24 hash bits + 0.5) / 2^24 lies in (0, 1), so q = -log u lies in
// [3e-8, 17.3] (the cut tail, q > 17.3, has probability 3e-8 and only ever makes a token lose).
inline void race_scores(const float* s, int64_t begin, int64_t n, uint32_t key_lo, uint32_t key_hi, float* out) {
    for (int64_t i = 0; i < n; ++i) {
        const uint32_t h = lowbias32(lowbias32(static_cast<uint32_t>(begin + i) ^ key_lo) ^ key_hi);
        const float u = (static_cast<float>(static_cast<int32_t>(h >> 8)) + 0.5f) * (1.0f / 16777216.0f);
        out[i] = s[begin + i] - log_positive(-log_positive(u));
    }
}

int64_t race_row(const float* s, int64_t n, uint64_t key) {
    constexpr int64_t kChunk = 512;
    float scores[kChunk];
    float best = -INFINITY;
    int64_t best_index = 0;
    for (int64_t begin = 0; begin < n; begin += kChunk) {
        const int64_t count = n - begin < kChunk ? n - begin : kChunk;
        race_scores(s, begin, count, static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32), scores);
        for (int64_t i = 0; i < count; ++i) {
            if (scores[i] > best) {
                best = scores[i];
                best_index = begin + i;
            }
        }
    }
    return best_index;
}

}  // namespace

extern "C" {

// rows [n, row bytes] of plain blocks of `qtype` -> out [n, k] float32
int tm_dequantize_rows(int qtype, const uint8_t* rows, int64_t n, int64_t k, float* out) {
    const int bytes = block_bytes(qtype);
    if (bytes < 0 || k % QK != 0 || n < 0) return -1;
    const int64_t blocks_per_row = k / QK;
    for (int64_t b = 0; b < n * blocks_per_row; ++b) dequantize_block(qtype, rows + b * bytes, out + b * QK);
    return 0;
}

// x [rows, cols] float32 with row stride ldx -> out [rows] int64: each row's argmax
int tm_argmax_rows(const float* x, int64_t rows, int64_t cols, int64_t ldx, int64_t* out) {
    if (rows < 0 || cols <= 0 || ldx < cols) return -1;
    for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * ldx, cols);
    return 0;
}

// x [rows, cols] float32 (dtype 0) or bfloat16 (dtype 1) with row stride ldx, in place: x[r, c] += bias[c] (bias of
// x's dtype), each sum taken in float32 and rounded once to x's dtype, as torch's `x + bias`. Only elementwise adds,
// so a row's result does not depend on the other rows (batch-invariant).
int tm_add_bias_rows(int dtype, void* x, int64_t rows, int64_t cols, int64_t ldx, const void* bias) {
    if (rows < 0 || cols < 0 || ldx < cols || (dtype != 0 && dtype != 1)) return -1;
    for (int64_t r = 0; r < rows; ++r) {
        if (dtype == 0) {
            float* row = static_cast<float*>(x) + r * ldx;
            const float* b = static_cast<const float*>(bias);
            for (int64_t c = 0; c < cols; ++c) row[c] += b[c];
        } else {
            uint16_t* row = static_cast<uint16_t*>(x) + r * ldx;
            const uint16_t* b = static_cast<const uint16_t*>(bias);
            for (int64_t c = 0; c < cols; ++c) row[c] = float_to_bf16(bf16_to_float(row[c]) + bf16_to_float(b[c]));
        }
    }
    return 0;
}

// s [rows, cols] float32 scaled logits (temperature applied, filtered tokens -inf) with row stride lds, keys [rows]
// -> out [rows] int64: each row's token by the exponential race with noise from its key (see race_row). A row whose
// every score is -inf or NaN gets 0.
int tm_race_rows(const float* s, int64_t rows, int64_t cols, int64_t lds, const uint64_t* keys, int64_t* out) {
    if (rows < 0 || cols <= 0 || lds < cols) return -1;
    for (int64_t r = 0; r < rows; ++r) out[r] = race_row(s + r * lds, cols, keys[r]);
    return 0;
}

}  // extern "C"
