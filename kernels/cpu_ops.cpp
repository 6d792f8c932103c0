// CPU kernels for the worker's per-layer hot path: paged attention of decode and other short sequences (a
// speculative-decoding verification step's few tokens) straight from the KV blocks, the KV write, RMSNorm with the
// residual add fused, rotary embedding in place, and SiLU(gate) * up.
//
// Built on first use by kernels/cpu_ops.py (g++ -O3 -march=native -fopenmp) and loaded with ctypes: a plain C ABI on
// raw pointers, so no torch headers and a one-second compile. Threads come from OpenMP; torch's CPU build links the
// same libgomp.so.1, which is already loaded when this library is, so both share one thread pool and
// torch.set_num_threads applies here too.
//
// Every kernel takes float32, bfloat16 or float16 tensors (dtype code 0, 1, 2) and computes in float32. Shapes and
// strides are checked by the Python wrappers, not here. The KV cache may instead be fp8 (cache dtype code 3: e4m3fn,
// 4: e5m2, stored as bytes) holding value / scale, vLLM's per-tensor scaled fp8 KV cache (kernels/kv_quant.py).

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

struct bf16 {
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(_Float16 x) { return static_cast<float>(x); }
inline float to_float(bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline _Float16 from_float<_Float16>(float x) { return static_cast<_Float16>(x); }
template <>
inline bf16 from_float<bf16>(float x) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((bits >> 16) | 0x40u)};  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return bf16{static_cast<uint16_t>(bits >> 16)};
}

// fp8, as torch's float8_e4m3fn (no infinities, largest finite 448, NaN 0x7f) and float8_e5m2 (IEEE-like).
struct fp8e4m3 {
  uint8_t bits;
};
struct fp8e5m2 {
  uint8_t bits;
};

inline uint32_t float_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}
inline float bits_float(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// Exact, branch-free (so loops over it vectorize): normal numbers rebias the exponent, subnormals are m * 2^-9.
inline float to_float(fp8e4m3 x) {
  const uint32_t magnitude = x.bits & 0x7fu;
  const float normal = bits_float((magnitude << 20) + (120u << 23));
  const float subnormal = static_cast<float>(magnitude & 7u) * 0x1p-9f;
  const float value = magnitude == 0x7fu ? __builtin_nanf("") : (magnitude >> 3) == 0 ? subnormal : normal;
  return x.bits & 0x80u ? -value : value;
}
// e5m2 is the top byte of a float16.
inline float to_float(fp8e5m2 x) {
  const uint16_t bits = static_cast<uint16_t>(x.bits) << 8;
  _Float16 h;
  std::memcpy(&h, &bits, sizeof h);
  return static_cast<float>(h);
}

// Round to nearest even as torch does (c10's fp8 conversions): a number below the smallest normal is rounded by the
// float adder itself (adding 2^k whose float ulp is the fp8 subnormal step), a normal one by adding half an fp8 ulp
// (less one when the kept mantissa is even) and truncating. e4m3fn saturates: anything from 448 up, infinity
// included, is 448 (torch's CPU conversion; vLLM's kernels saturate too); NaN stays NaN. e5m2 overflows to infinity.
template <>
inline fp8e4m3 from_float<fp8e4m3>(float x) {
  const uint32_t bits = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  uint8_t result;
  if (magnitude > 0x7f800000u) {
    result = 0x7f;
  } else if (magnitude >= 0x43e00000u) {  // 448
    result = 0x7e;
  } else if (magnitude < (121u << 23)) {  // below 2^-6
    constexpr uint32_t denormal_mask = 141u << 23;  // 2^14, whose float ulp is 2^-9
    result = static_cast<uint8_t>(float_bits(bits_float(magnitude) + bits_float(denormal_mask)) - denormal_mask);
  } else {
    const uint32_t odd = (magnitude >> 20) & 1u;
    result = static_cast<uint8_t>((magnitude + (static_cast<uint32_t>(7 - 127) << 23) + 0x7ffffu + odd) >> 20);
  }
  return fp8e4m3{static_cast<uint8_t>(result | sign)};
}
template <>
inline fp8e5m2 from_float<fp8e5m2>(float x) {
  const uint32_t bits = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  uint8_t result;
  if (magnitude >= (143u << 23)) {  // 65536 and up: infinity, or NaN
    result = magnitude > 0x7f800000u ? 0x7f : 0x7c;
  } else if (magnitude < (113u << 23)) {  // below 2^-14
    constexpr uint32_t denormal_mask = 134u << 23;  // 2^7, whose float ulp is 2^-16
    result = static_cast<uint8_t>(float_bits(bits_float(magnitude) + bits_float(denormal_mask)) - denormal_mask);
  } else {
    const uint32_t odd = (magnitude >> 21) & 1u;
    result = static_cast<uint8_t>((magnitude + (static_cast<uint32_t>(15 - 127) << 23) + 0xfffffu + odd) >> 21);
  }
  return fp8e5m2{static_cast<uint8_t>(result | sign)};
}

// exp(x) for x <= 0 (softmax after subtracting the row max, SiLU on -|x|): Cephes' expf polynomial, within 2 ulp of
// the exact value, in plain float arithmetic so that the loops calling it vectorize (glibc's expf would not,
// without -ffast-math). Below -87 it returns exp(-87) ~ 1.6e-38 rather than a denormal or zero.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;  // by value: std::max returns a reference, which keeps GCC from vectorizing
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * (r * r) + r + 1.0f;
  const int32_t exponent = (static_cast<int32_t>(n) + 127) << 23;
  float two_to_n;
  std::memcpy(&two_to_n, &exponent, sizeof two_to_n);
  return y * two_to_n;
}

// 16 floats as one vector (GCC vector extensions: AVX-512 registers where the CPU has them, pairs of AVX2 ones or
// SSE quads where it does not).
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

template <typename T>
inline f32x16 load16(const T* p) {
  f32x16 v;
  for (int lane = 0; lane < 16; ++lane) v[lane] = to_float(p[lane]);
  return v;
}

// 16 fp8 values at once, as `to_float` converts one (lane by lane the conversion does not vectorize, and made fp8
// decode attention several times slower than float32's).
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef _Float16 f16x16 __attribute__((vector_size(32)));

// 16 bytes widened to 16 uint32 lanes (GCC lowers __builtin_convertvector of bytes to a lane-by-lane extract and insert)
inline u32x16 widen16(const uint8_t* p) {
#if defined(__AVX512F__)
  return (u32x16)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  u8x16 bytes;
  std::memcpy(&bytes, p, sizeof bytes);
  return __builtin_convertvector(bytes, u32x16);
#endif
}

inline f32x16 load16(const fp8e4m3* p) {
#if defined(__AVX512F__)
  // as a float16 with the same fields (exponent bias 15, not 7), times 2^8: exact, subnormals included
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i magnitude = _mm256_and_si256(bytes, _mm256_set1_epi16(0x7f));
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x80)), 8);
  __m256i half = _mm256_or_si256(_mm256_slli_epi16(magnitude, 7), sign);
  half = _mm256_blendv_epi8(half, _mm256_set1_epi16(0x7e00), _mm256_cmpeq_epi16(magnitude, _mm256_set1_epi16(0x7f)));
  return (f32x16)_mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.0f));
#else
  const u32x16 x = widen16(&p->bits);
  const u32x16 magnitude = x & 0x7fu;
  const u32x16 normal = (magnitude << 20) + (120u << 23);
  const f32x16 subnormal_value = __builtin_convertvector(magnitude & 7u, f32x16) * 0x1p-9f;
  u32x16 subnormal;
  std::memcpy(&subnormal, &subnormal_value, sizeof subnormal);
  const u32x16 nan = u32x16{} + 0x7fc00000u;
  u32x16 bits = (magnitude >> 3) == 0 ? subnormal : normal;
  bits = magnitude == 0x7fu ? nan : bits;
  bits |= (x & 0x80u) << 24;
  f32x16 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
#endif
}
inline f32x16 load16(const fp8e5m2* p) {  // e5m2 is the top byte of a float16
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (f32x16)_mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8));
#else
  const u16x16 halves = __builtin_convertvector(widen16(&p->bits), u16x16) << 8;
  f16x16 h;
  std::memcpy(&h, &halves, sizeof h);
  return __builtin_convertvector(h, f32x16);
#endif
}
template <typename C>
constexpr bool is_fp8 = std::is_same_v<C, fp8e4m3> || std::is_same_v<C, fp8e5m2>;

// Lane i of the result is the sum of the 16 lanes of v[i]: a transpose and add in four halving rounds, 15 adds and
// 30 two-source shuffles for 16 dot products instead of a horizontal reduction (4 shuffles, 4 adds) for each.
inline f32x16 sum_lanes16(f32x16 v[16]) {
  const i32x16 lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const i32x16 lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const i32x16 lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const i32x16 lo1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  for (int width = 16, round = 0; width > 1; width /= 2, ++round) {
    const i32x16 lo = round == 0 ? lo8 : round == 1 ? lo4 : round == 2 ? lo2 : lo1;
    const i32x16 hi = lo + (8 >> round);
    for (int j = 0; j < width / 2; ++j) {
      v[j] = __builtin_shuffle(v[2 * j], v[2 * j + 1], lo) + __builtin_shuffle(v[2 * j], v[2 * j + 1], hi);
    }
  }
  return v[0];
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define TM_AVX2_ATTENTION 1
#endif

#if defined(TM_AVX2_ATTENTION)
// AVX2: a 16-lane vector is a pair of ymm registers, and GCC lowers the 16-lane two-source shuffles of
// `sum_lanes16` lane by lane (inserts and extracts), which made scoring keys ~7x slower than with AVX-512. Keys are
// scored eight at a time instead (`dot_keys`; four for a block's last few): each 8-float chunk of the query is loaded
// once for the eight keys, and their sums are reduced together by horizontal adds.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
}
inline __m256 load8(const _Float16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
// fp8 through float16 and F16C, eight bytes at a time, as the AVX-512 `load16` does sixteen (a first version widened
// a copy with the portable 16-lane code, which GCC lowers lane by lane on AVX2: fp8 decode ran 4x slower than
// float32's). e4m3: a float16 with the same fields (exponent bias 15, not 7), times 2^8; e5m2 is a float16's top byte.
inline __m256 load8(const fp8e4m3* p) {
  const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i magnitude = _mm_and_si128(bytes, _mm_set1_epi16(0x7f));
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(bytes, _mm_set1_epi16(0x80)), 8);
  __m128i half = _mm_or_si128(_mm_slli_epi16(magnitude, 7), sign);
  half = _mm_blendv_epi8(half, _mm_set1_epi16(0x7e00), _mm_cmpeq_epi16(magnitude, _mm_set1_epi16(0x7f)));
  return _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.0f));
}
inline __m256 load8(const fp8e5m2* p) {
  const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_slli_epi16(bytes, 8));
}

constexpr bool kScoresFourKeysAtATime = true;

// s[i] = q . key_i for KEYS (4 or 8) keys `token_stride` elements apart; q is HEAD_DIM floats. A key's sum runs over
// its 8-float chunks in order, then over the chunk's lanes by a fixed tree, so a row's score never depends on the
// other rows, nor on KEYS. 8 keys keep 8 FMA chains in flight (a chain waits out the FMA's latency: with 4 the FMA
// units sat half idle); 4 serve a block's last few keys.
template <typename T, int HEAD_DIM, int KEYS>
inline void dot_keys(const float* q, const T* keys, int64_t token_stride, float* s) {
  static_assert(HEAD_DIM % 8 == 0 && (KEYS == 4 || KEYS == 8));
  __m256 acc[KEYS];
  const __m256 q0 = _mm256_loadu_ps(q);
  for (int i = 0; i < KEYS; ++i) acc[i] = _mm256_mul_ps(q0, load8(keys + i * token_stride));
  for (int c = 8; c < HEAD_DIM; c += 8) {
    const __m256 qc = _mm256_loadu_ps(q + c);
    for (int i = 0; i < KEYS; ++i) acc[i] = _mm256_fmadd_ps(qc, load8(keys + i * token_stride + c), acc[i]);
  }
  // [k0 lo, k1 lo, k2 lo, k3 lo | k0 hi, k1 hi, k2 hi, k3 hi]: each the sum of 4 lanes of its key's 128-bit half
  const __m256 first = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  if constexpr (KEYS == 4) {
    _mm_storeu_ps(s, _mm_add_ps(_mm256_castps256_ps128(first), _mm256_extractf128_ps(first, 1)));
  } else {
    const __m256 second = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    // [k0..k3 lo | k4..k7 lo] + [k0..k3 hi | k4..k7 hi]
    const __m256 low_halves = _mm256_permute2f128_ps(first, second, 0x20);
    const __m256 high_halves = _mm256_permute2f128_ps(first, second, 0x31);
    _mm256_storeu_ps(s, _mm256_add_ps(low_halves, high_halves));
  }
}

template <typename T, int HEAD_DIM>
inline void dot4(const float* q, const T* keys, int64_t token_stride, float* s) {
  dot_keys<T, HEAD_DIM, 4>(q, keys, token_stride, s);
}

template <typename T, int HEAD_DIM>
inline void dot16(const float* q, const T* keys, int64_t token_stride, float* s) {
  for (int i = 0; i < 16; i += 8) dot_keys<T, HEAD_DIM, 8>(q, keys + i * token_stride, token_stride, s + i);
}
#else
constexpr bool kScoresFourKeysAtATime = false;

template <typename T, int HEAD_DIM>
inline void dot4(const float*, const T*, int64_t, float*) {}

// s[i] = q . key_i for 16 keys `token_stride` elements apart; q is HEAD_DIM floats.
template <typename T, int HEAD_DIM>
inline void dot16(const float* q, const T* keys, int64_t token_stride, float* s) {
  constexpr int chunks = HEAD_DIM / 16;
  f32x16 qv[chunks], partial[16];
  for (int c = 0; c < chunks; ++c) qv[c] = load16(q + 16 * c);
  for (int i = 0; i < 16; ++i) {
    const T* key = keys + i * token_stride;
    f32x16 sum = qv[0] * load16(key);
    for (int c = 1; c < chunks; ++c) sum += qv[c] * load16(key + 16 * c);
    partial[i] = sum;
  }
  const f32x16 dots = sum_lanes16(partial);
  std::memcpy(s, &dots, sizeof dots);
}

#endif

// a += sum over keys i in [begin, end) of p[i] * value_i (rows `token_stride` elements apart); the row's accumulator
// stays in registers over the block's keys. (Inlined by force: as a call, the 16-lane accumulators went through the
// stack and the AVX-512 pass ran 1.6x slower.)
template <typename C, int HEAD_DIM>
__attribute__((always_inline)) inline void accumulate_values(float* __restrict__ a, const float* __restrict__ p,
                                                             const C* values, int64_t token_stride, int64_t begin,
                                                             int64_t end) {
#if defined(TM_AVX2_ATTENTION)
  // 8-lane registers and a broadcast weight: GCC's 16-lane vectors of scalar * vector went through the stack here
  constexpr int chunks = HEAD_DIM / 8;
  __m256 sum[chunks];
  for (int c = 0; c < chunks; ++c) sum[c] = _mm256_loadu_ps(a + 8 * c);
  for (int64_t i = begin; i < end; ++i) {
    const C* __restrict__ value = values + i * token_stride;
    const __m256 weight = _mm256_broadcast_ss(p + i);
    for (int c = 0; c < chunks; ++c) sum[c] = _mm256_fmadd_ps(weight, load8(value + 8 * c), sum[c]);
  }
  for (int c = 0; c < chunks; ++c) _mm256_storeu_ps(a + 8 * c, sum[c]);
#else
  constexpr int chunks = HEAD_DIM / 16;
  f32x16 sum[chunks];
  std::memcpy(sum, a, sizeof sum);
  for (int64_t i = begin; i < end; ++i) {
    const C* __restrict__ value = values + i * token_stride;
    for (int c = 0; c < chunks; ++c) sum[c] += p[i] * load16(value + 16 * c);
  }
  std::memcpy(a, sum, sizeof sum);
#endif
}

// A block's prefetch spread over the `parts` query rows that read the block before it: part i takes its share of the
// block's cache lines (a block's tokens are one contiguous run). The next blocks of a sequence are wherever its block
// table says, so the hardware prefetcher cannot see them coming; a share per row overlaps the loads with the
// arithmetic instead of queueing them up in one burst. (One division a block: per row, the shares' bounds cost as
// much as the prefetches.)
struct BlockPrefetch {
  const char* next = nullptr;
  const char* end = nullptr;
  int64_t share = 0;  // bytes a part prefetches, a multiple of 64

  BlockPrefetch(const void* block, int64_t bytes, int64_t parts) {
    if (block == nullptr || bytes <= 0) return;
    next = static_cast<const char*>(block);
    end = next + bytes;
    share = ((bytes + parts - 1) / parts + 63) / 64 * 64;
  }
  inline void part() {
    const char* stop = std::min(end, next + share);
    for (; next < stop; next += 64) __builtin_prefetch(next, 0, 1);
  }
};

// `rows` rows of `row_len` values `src_stride` apart, as float32 rows packed one after the other in `dst`.
template <typename C>
inline void widen_rows(const C* src, int64_t rows, int64_t row_len, int64_t src_stride, float* dst) {
  for (int64_t i = 0; i < rows; ++i, src += src_stride, dst += row_len) {
    int64_t e = 0;
#if defined(TM_AVX2_ATTENTION)
    for (; e + 8 <= row_len; e += 8) _mm256_storeu_ps(dst + e, load8(src + e));
#else
    for (; e + 16 <= row_len; e += 16) {
      const f32x16 v = load16(src + e);
      std::memcpy(dst + e, &v, sizeof v);
    }
#endif
    for (; e < row_len; ++e) dst[e] = to_float(src[e]);
  }
}

// for i in [0, n): body(i), split over the OpenMP team when `parallel` and there is more than one thread, else
// inline. Even a one-thread OpenMP region costs ~0.4 us (libgomp sets up a team), and a batch-1 decode step makes
// ~150 calls of these kernels: most of a one-row RMSNorm's time was its region (0.9 us a call, 0.19 inline).
template <typename Body>
inline void parallel_for(int64_t n, bool parallel, Body&& body) {
  if (parallel && omp_get_max_threads() > 1) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) body(i);
  } else {
    for (int64_t i = 0; i < n; ++i) body(i);
  }
}

constexpr int64_t PREFETCH_BLOCKS = 1;  // how far ahead, in blocks, a pass prefetches
// Keys per softmax chunk (rounded to whole blocks): a sequence's keys are taken in chunks at fixed positions, each
// chunk's softmax partial (max, sum, weighted values) computed alone and the partials merged in chunk order. So a
// few sequences' chunks can run on several threads (flash-decoding's split), and a token's result is the same bits
// whichever thread ran which chunk, at any batch size.
constexpr int64_t KEYS_PER_CHUNK = 64;

// A row's softmax partial: [max score, sum of exps, head_dim weighted value sums]; sum 0: the row saw no key.
// `merge_partial` folds one into a running one, the same arithmetic wherever the partial was computed.
// (Out of line: one compiled body, so every caller merges with the same instructions.)
__attribute__((noinline)) void merge_partial(const float* partial, float* run, int64_t head_dim) {
  if (partial[1] == 0.0f) return;
  if (run[1] == 0.0f) {
    std::memcpy(run, partial, (head_dim + 2) * sizeof(float));
    return;
  }
  const float max_score = std::max(run[0], partial[0]);
  const float a = exp_nonpositive(run[0] - max_score), b = exp_nonpositive(partial[0] - max_score);
  run[0] = max_score;
  run[1] = std::fma(run[1], a, partial[1] * b);
  for (int64_t d = 2; d < head_dim + 2; ++d) run[d] = std::fma(run[d], a, partial[d] * b);
}

// Few query tokens per sequence: the sequences of 1 to max_query_len query tokens (by their query_start_loc span;
// the others are left untouched) over their seq_lens[b] cached tokens, the last q_len of which are their queries'
// own: query i (of q_len) sits at position p_i = seq_len - q_len + i and sees keys [0, p_i]. One token per sequence
// is decoding; a few are a speculative-decoding verification step (1 + k draft tokens) or a short prompt.
// A sequence's keys are read in chunks of KEYS_PER_CHUNK (whole blocks, at fixed positions): a chunk's K blocks, then
// its V blocks, in table order, prefetching PREFETCH_BLOCKS ahead, for all its query rows (every query token times
// every query head) and all kv heads, so each block's tokens are one contiguous run read from memory once and from L1
// for the other rows. A chunk's scores are softmaxed against its own max and its values summed; the chunks' partials
// are merged in order (`merge_partial`). A work item is a sequence, or, when there are too few sequences to keep the
// threads busy, one chunk of one; its partials are then kept and merged after the chunks. A row scores and sums only
// the keys it sees, so the causal mask costs nothing. (There is no gain in fusing a GQA group's rows over one load of
// each key or value row on AVX-512: 48 partial sums spill, and scoring measured 1.5x slower; the values' 1.2x.)
// With a sliding window (window > 0) query i sees keys [p_i - window + 1, p_i]: the reads start at the block holding
// the first key the earliest query sees (blocks before it may have been freed and reused), and each row skips the
// keys before its own window.
// HEAD_DIM > 0 fixes the head size at compile time, which keeps a head's accumulator in registers and scores 16 keys
// at a time (`dot16`); HEAD_DIM == 0 is the general case.
// The caches hold C: T, a 16-bit float under float32 T, or fp8 holding key / k_scale and value / v_scale. k_scale is
// folded into the query's scale (q . (k_scale k) = (k_scale q) . k) and v_scale into the output, so the loops only
// convert; 1.0 for any cache but fp8.
template <typename T, typename C, int HEAD_DIM>
void decode_attention(T* out, const T* query, int64_t query_token_stride, const C* k_cache, const C* v_cache,
                      int64_t block_size, int64_t num_kv_heads, int64_t num_heads, int64_t runtime_head_dim,
                      const int32_t* block_tables, int64_t block_table_stride, const int32_t* query_start_loc,
                      const int32_t* seq_lens, int64_t num_seqs, int64_t max_query_len, float scale, int64_t window,
                      float k_scale, float v_scale) {
  const float query_scale = scale * k_scale;
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : runtime_head_dim;
  const int64_t partial_floats = head_dim + 2;
  auto query_len_of = [&](int64_t seq) -> int64_t { return query_start_loc[seq + 1] - query_start_loc[seq]; };
  auto handles = [&](int64_t seq) {
    const int64_t q_len = query_len_of(seq);
    return q_len >= 1 && q_len <= max_query_len && seq_lens[seq] >= q_len;
  };
  const int64_t chunk_blocks = std::max<int64_t>(1, KEYS_PER_CHUNK / block_size);
  const int64_t chunk_keys = chunk_blocks * block_size;
  // The blocks [*first, *end) a sequence reads: from the block of the earliest query's first visible key.
  auto block_range = [&](int64_t seq, int64_t* first, int64_t* end) {
    const int64_t seq_len = seq_lens[seq], q_len = query_len_of(seq);
    const int64_t first_key = window > 0 ? seq_len - q_len + 1 - window : 0;
    *first = first_key > 0 ? first_key / block_size : 0;
    *end = (seq_len + block_size - 1) / block_size;
  };
  // A sequence's chunks, [*first, *end) (none if this call leaves it alone).
  auto chunk_range = [&](int64_t seq, int64_t* first, int64_t* end) {
    *first = *end = 0;
    if (!handles(seq)) return;
    int64_t first_block, end_block;
    block_range(seq, &first_block, &end_block);
    *first = first_block / chunk_blocks;
    *end = (end_block + chunk_blocks - 1) / chunk_blocks;
  };
  const int64_t group = num_heads / num_kv_heads;
  const int64_t cache_token_stride = num_kv_heads * head_dim;
  const int64_t cache_block_stride = block_size * cache_token_stride;
  const int64_t row_bytes = cache_token_stride * static_cast<int64_t>(sizeof(C));

  // Work items. Split: one chunk each, (item_seq, item_chunk), its rows' partials at partial_offset (floats) in
  // `partials`, a sequence's items consecutive in chunk order from seq_items[seq].
  const int threads = omp_get_max_threads();
  const bool split = threads > 1 && num_seqs < 2 * threads;
  std::vector<int64_t> item_seq, item_chunk, partial_offset, seq_items;
  std::vector<float> partials;
  if (split) {
    seq_items.assign(num_seqs + 1, 0);
    int64_t floats = 0;
    for (int64_t seq = 0; seq < num_seqs; ++seq) {
      int64_t first, end;
      chunk_range(seq, &first, &end);
      seq_items[seq] = static_cast<int64_t>(item_seq.size());
      for (int64_t chunk = first; chunk < end; ++chunk) {
        item_seq.push_back(seq);
        item_chunk.push_back(chunk);
        partial_offset.push_back(floats);
        floats += query_len_of(seq) * num_heads * partial_floats;
      }
    }
    seq_items[num_seqs] = static_cast<int64_t>(item_seq.size());
    partials.resize(floats);
  }
  const int64_t num_items = split ? static_cast<int64_t>(item_seq.size()) : num_seqs;

  // The work of each thread of the team (or of the calling thread alone: see parallel_for).
  auto team_work = [&]() {
    // Scratch kept between calls (a call's allocations measured ~0.3 us of a ~2 us fixed cost, thirty times a token)
    static thread_local std::vector<float> q, scores, chunk_partials, run, wide;
    static thread_local std::vector<int64_t> row_lead, row_end, row_head;
    const int64_t item_stride = omp_get_num_threads();
    // This thread's chunk after (seq, chunk) (the items are round-robin): its sequence, or -1 if none.
    auto next_chunk = [&](int64_t item, int64_t seq, int64_t chunk, int64_t* next) -> int64_t {
      if (!split) {
        int64_t first, end;
        chunk_range(seq, &first, &end);
        if (chunk + 1 < end) return *next = chunk + 1, seq;
        for (int64_t s = item + item_stride; s < num_seqs; s += item_stride) {
          chunk_range(s, &first, &end);
          if (first < end) return *next = first, s;
        }
        return -1;
      }
      if (item + item_stride >= num_items) return -1;
      *next = item_chunk[item + item_stride];
      return item_seq[item + item_stride];
    };
    // The blocks chunk `chunk` of `seq` reads, [*begin, *end).
    auto chunk_block_range = [&](int64_t seq, int64_t chunk, int64_t* begin, int64_t* end) {
      int64_t first, last;
      block_range(seq, &first, &last);
      *begin = std::max(first, chunk * chunk_blocks);
      *end = std::min(last, (chunk + 1) * chunk_blocks);
    };
    auto block_of = [&](const C* cache, int64_t seq, int64_t block, int64_t* count) {
      *count = std::min<int64_t>(block_size, seq_lens[seq] - block * block_size);
      return cache + block_tables[seq * block_table_stride + block] * cache_block_stride;
    };

    // The softmax partials of chunk `chunk` of `seq` for every row (row r: query token r / num_heads, query head
    // r % num_heads) at `partial` (partial_floats a row); (next_seq, next) is the chunk this thread reads next.
    auto chunk_partial = [&](int64_t seq, int64_t chunk, int64_t next_seq, int64_t next, float* partial) {
      const int64_t q_len = query_len_of(seq), seq_len = seq_lens[seq], rows = q_len * num_heads;
      const int64_t chunk_start = chunk * chunk_keys, chunk_end = std::min(seq_len, chunk_start + chunk_keys);
      auto end_of = [&](int64_t i) { return seq_len - q_len + 1 + i; };  // absolute: query i sees keys < end_of(i)
      auto lead_of = [&](int64_t i) { return window > 0 ? std::max<int64_t>(0, end_of(i) - window) : 0; };
      int64_t block_begin, block_end;
      chunk_block_range(seq, chunk, &block_begin, &block_end);
      const int64_t n = block_end - block_begin;
      // Block `position` of the read order: this chunk's K blocks, its V blocks, then the next chunk's K blocks.
      auto pass_block = [&](int64_t position, int64_t* count) -> const C* {
        *count = 0;
        if (position < 2 * n) {
          const bool is_key = position < n;
          return block_of(is_key ? k_cache : v_cache, seq, block_begin + position % n, count);
        }
        if (next_seq < 0) return nullptr;
        int64_t begin, end;
        chunk_block_range(next_seq, next, &begin, &end);
        if (begin + position - 2 * n >= end) return nullptr;
        return block_of(k_cache, next_seq, begin + position - 2 * n, count);
      };
      // fp8 blocks are widened to float32 once (`wide`), not once per query head reading them: the conversion, not
      // the memory, bounds an fp8 pass (e4m3 takes ten instructions per eight values on AVX2). A 16-bit block's
      // conversion is one instruction, and widening it measured slower (batch-32 decode 1.35x float32's, not 1.46x).
      auto block_rows = [&](const C* block, int64_t count, auto&& pass) {
        if constexpr (is_fp8<C>) {
          wide.resize(block_size * cache_token_stride);
          widen_rows(block, count, cache_token_stride, cache_token_stride, wide.data());
          pass(static_cast<const float*>(wide.data()));
        } else {
          pass(block);
        }
      };
      // Per row, worked out once a chunk rather than in the block loops: the keys it sees, [row_lead, row_end)
      // (absolute), and where its kv head's slice of a token row starts.
      row_lead.resize(rows);
      row_end.resize(rows);
      row_head.resize(rows);
      for (int64_t row = 0; row < rows; ++row) {
        row_lead[row] = lead_of(row / num_heads);
        row_end[row] = end_of(row / num_heads);
        row_head[row] = row % num_heads / group * head_dim;
      }
      // Each row's keys in the block starting at key `start`: [*begin, *end) of its `count`.
      auto row_keys = [&](int64_t row, int64_t start, int64_t count, int64_t* begin, int64_t* end) {
        *begin = std::max<int64_t>(0, row_lead[row] - start);
        *end = std::min(count, row_end[row] - start);
      };

      scores.resize(rows * chunk_keys);
      for (int64_t j = 0; j < n; ++j) {
        int64_t count, ahead_count;
        const C* block = block_of(k_cache, seq, block_begin + j, &count);
        const C* ahead = pass_block(j + PREFETCH_BLOCKS, &ahead_count);
        const int64_t start = (block_begin + j) * block_size;
        block_rows(block, count, [&](const auto* keys) {
          using K = std::remove_cv_t<std::remove_pointer_t<decltype(keys)>>;
          BlockPrefetch prefetch(ahead, ahead_count * row_bytes, rows);
          for (int64_t row = 0; row < rows; ++row) {
            prefetch.part();
            int64_t begin, end;
            row_keys(row, start, count, &begin, &end);
            const float* __restrict__ qr = q.data() + row * head_dim;
            const K* head_keys = keys + row_head[row];
            float* __restrict__ s = scores.data() + row * chunk_keys + start - chunk_start;
            int64_t i = begin;
            if constexpr (HEAD_DIM > 0 && HEAD_DIM % 16 == 0) {
              for (; i + 16 <= end; i += 16) {
                dot16<K, HEAD_DIM>(qr, head_keys + i * cache_token_stride, cache_token_stride, s + i);
              }
              if constexpr (kScoresFourKeysAtATime) {
                for (; i + 4 <= end; i += 4) {
                  dot4<K, HEAD_DIM>(qr, head_keys + i * cache_token_stride, cache_token_stride, s + i);
                }
              }
            }
            for (; i < end; ++i) {
              const K* __restrict__ key = head_keys + i * cache_token_stride;
              float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
              for (int64_t d = 0; d < head_dim; ++d) dot += qr[d] * to_float(key[d]);
              s[i] = dot;
            }
          }
        });
      }

      for (int64_t row = 0; row < rows; ++row) {
        float* out_row = partial + row * partial_floats;
        std::fill(out_row, out_row + partial_floats, 0.0f);
        const int64_t lead = std::max(row_lead[row], chunk_start) - chunk_start;
        const int64_t end = std::min(row_end[row], chunk_end) - chunk_start;
        if (lead >= end) continue;
        float* s = scores.data() + row * chunk_keys;
        float max_score = s[lead];
#pragma omp simd reduction(max : max_score)
        for (int64_t t = lead; t < end; ++t) max_score = s[t] > max_score ? s[t] : max_score;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = lead; t < end; ++t) {
          s[t] = exp_nonpositive(s[t] - max_score);
          sum += s[t];
        }
        out_row[0] = max_score;
        out_row[1] = sum;
      }

      for (int64_t j = 0; j < n; ++j) {
        int64_t count, ahead_count;
        const C* block = block_of(v_cache, seq, block_begin + j, &count);
        const C* ahead = pass_block(n + j + PREFETCH_BLOCKS, &ahead_count);
        const int64_t start = (block_begin + j) * block_size;
        block_rows(block, count, [&](const auto* values) {
          using V = std::remove_cv_t<std::remove_pointer_t<decltype(values)>>;
          BlockPrefetch prefetch(ahead, ahead_count * row_bytes, rows);
          for (int64_t row = 0; row < rows; ++row) {
            prefetch.part();
            int64_t begin, end;
            row_keys(row, start, count, &begin, &end);
            const float* __restrict__ p = scores.data() + row * chunk_keys + start - chunk_start;
            const V* head_values = values + row_head[row];
            float* __restrict__ a = partial + row * partial_floats + 2;
            if constexpr (HEAD_DIM > 0 && HEAD_DIM % 16 == 0) {
              accumulate_values<V, HEAD_DIM>(a, p, head_values, cache_token_stride, begin, end);
            } else {
              for (int64_t i = begin; i < end; ++i) {
                const V* __restrict__ value = head_values + i * cache_token_stride;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) a[d] += p[i] * to_float(value[d]);
              }
            }
          }
        });
      }
    };

    auto load_query = [&](int64_t seq) {  // the sequence's query rows, scaled
      const int64_t token = query_start_loc[seq], width = num_heads * head_dim;
      q.resize(query_len_of(seq) * width);
      for (int64_t i = 0; i < query_len_of(seq); ++i) {
        const T* q_in = query + (token + i) * query_token_stride;
        for (int64_t d = 0; d < width; ++d) q[i * width + d] = to_float(q_in[d]) * query_scale;
      }
    };
    // The merged rows (partial_floats each) of `seq` as its output rows.
    auto write_out = [&](int64_t seq, const float* merged) {
      const int64_t token = query_start_loc[seq], rows = query_len_of(seq) * num_heads;
      for (int64_t row = 0; row < rows; ++row) {
        const float* m = merged + row * partial_floats;
        const float inv_sum = 1.0f / m[1];
        T* o = out + (token * num_heads + row) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = from_float<T>(m[2 + d] * inv_sum * v_scale);
      }
    };
    // One chunk's partials (`rows` of them) folded into `run`, this thread's running merge.
    auto merge_rows = [&](const float* partial, int64_t rows) {
      for (int64_t row = 0; row < rows; ++row) {
        merge_partial(partial + row * partial_floats, run.data() + row * partial_floats, head_dim);
      }
    };

    // A split item is one chunk whose partials are kept for the merge below; an unsplit one, a sequence whose chunks
    // are merged as they come. (One call site of chunk_partial: the same code computes every chunk, so a token's
    // result does not depend on which path, thread or batch computed it.)
#pragma omp for schedule(static, 1)
    for (int64_t item = 0; item < num_items; ++item) {
      int64_t seq = item, first, end;
      if (split) {
        seq = item_seq[item];
        first = item_chunk[item];
        end = first + 1;
      } else {
        chunk_range(seq, &first, &end);
      }
      if (first >= end) continue;
      const int64_t rows = query_len_of(seq) * num_heads;
      load_query(seq);
      if (!split) {
        run.assign(rows * partial_floats, 0.0f);
        chunk_partials.resize(rows * partial_floats);
      }
      for (int64_t chunk = first; chunk < end; ++chunk) {
        int64_t next;
        const int64_t next_seq = next_chunk(item, seq, chunk, &next);
        float* partial = split ? partials.data() + partial_offset[item] : chunk_partials.data();
        chunk_partial(seq, chunk, next_seq, next, partial);
        if (!split) merge_rows(partial, rows);
      }
      if (!split) write_out(seq, run.data());
    }
    if (split) {  // (after the loop's barrier) each sequence's chunk partials merged in order
#pragma omp for schedule(static, 1)
      for (int64_t seq = 0; seq < num_seqs; ++seq) {
        if (seq_items[seq] == seq_items[seq + 1]) continue;
        const int64_t rows = query_len_of(seq) * num_heads;
        run.assign(rows * partial_floats, 0.0f);
        for (int64_t item = seq_items[seq]; item < seq_items[seq + 1]; ++item) {
          merge_rows(partials.data() + partial_offset[item], rows);
        }
        write_out(seq, run.data());
      }
    }
  };
  if (threads > 1) {
#pragma omp parallel
    team_work();
  } else {
    team_work();
  }
}

template <typename T, typename C>
void decode_attention_any(T* out, const T* query, int64_t query_token_stride, const C* k_cache, const C* v_cache,
                          int64_t block_size, int64_t num_kv_heads, int64_t num_heads, int64_t head_dim,
                          const int32_t* block_tables, int64_t block_table_stride, const int32_t* query_start_loc,
                          const int32_t* seq_lens, int64_t num_seqs, int64_t max_query_len, float scale,
                          int64_t window, float k_scale, float v_scale) {
  auto run = [&](auto fixed_head_dim) {
    decode_attention<T, C, decltype(fixed_head_dim)::value>(out, query, query_token_stride, k_cache, v_cache,
                                                             block_size, num_kv_heads, num_heads, head_dim,
                                                             block_tables, block_table_stride, query_start_loc,
                                                             seq_lens, num_seqs, max_query_len, scale, window,
                                                             k_scale, v_scale);
  };
  if (head_dim == 64) return run(std::integral_constant<int, 64>{});
  if (head_dim == 128) return run(std::integral_constant<int, 128>{});
  run(std::integral_constant<int, 0>{});
}

// Copy token t's key and value rows ([num_kv_heads * head_dim], contiguous) to flat slot slots[t]; slot < 0 skips.
// A cache of another type (C other than T) stores key / k_scale and value / v_scale, divided in float32 and rounded to
// nearest even as torch would (the scales are 1.0 for a 16-bit cache).
template <typename T, typename C>
void write_kv(const T* key, int64_t key_token_stride, const T* value, int64_t value_token_stride, C* k_cache,
              C* v_cache, const int64_t* slots, int64_t num_tokens, int64_t row_size, float k_scale, float v_scale) {
  parallel_for(num_tokens, num_tokens > 64, [&](int64_t t) {
    if (slots[t] < 0) return;
    if constexpr (std::is_same_v<T, C>) {
      std::memcpy(k_cache + slots[t] * row_size, key + t * key_token_stride, row_size * sizeof(T));
      std::memcpy(v_cache + slots[t] * row_size, value + t * value_token_stride, row_size * sizeof(T));
    } else {
      const T* key_row = key + t * key_token_stride;
      const T* value_row = value + t * value_token_stride;
      C* k_row = k_cache + slots[t] * row_size;
      C* v_row = v_cache + slots[t] * row_size;
      for (int64_t i = 0; i < row_size; ++i) k_row[i] = from_float<C>(to_float(key_row[i]) / k_scale);
      for (int64_t i = 0; i < row_size; ++i) v_row[i] = from_float<C>(to_float(value_row[i]) / v_scale);
    }
  });
}

// Hugging Face's RMSNorm, row by row: h = x (+ residual, rounded to T, stored to residual_out when given);
// out = weight * T(h * rsqrt(mean(h^2) + eps)).
template <typename T>
void rms_norm(T* out, int64_t out_stride, T* residual_out, int64_t residual_out_stride, const T* x,
              int64_t x_stride, const T* residual, int64_t residual_stride, const T* weight, int64_t num_rows,
              int64_t hidden, float eps) {
  // One row (a batch-1 decode step) runs inline on the calling thread (61 calls a step).
  parallel_for(num_rows, num_rows > 1, [&](int64_t row) {
    thread_local std::vector<float> h;
    h.resize(hidden);
    const T* x_row = x + row * x_stride;
    if (residual != nullptr) {
      const T* r_row = residual + row * residual_stride;
      T* sum_row = residual_out + row * residual_out_stride;
      for (int64_t i = 0; i < hidden; ++i) {
        sum_row[i] = from_float<T>(to_float(x_row[i]) + to_float(r_row[i]));
        h[i] = to_float(sum_row[i]);
      }
    } else {
      for (int64_t i = 0; i < hidden; ++i) h[i] = to_float(x_row[i]);
    }
    float sum_squares = 0.0f;
#pragma omp simd reduction(+ : sum_squares)
    for (int64_t i = 0; i < hidden; ++i) sum_squares += h[i] * h[i];
    const float inv_rms = 1.0f / std::sqrt(sum_squares / static_cast<float>(hidden) + eps);
    T* out_row = out + row * out_stride;
    for (int64_t i = 0; i < hidden; ++i) {
      out_row[i] = from_float<T>(to_float(weight[i]) * to_float(from_float<T>(h[i] * inv_rms)));
    }
  });
}

// NeoX (rotate-half) rotary embedding in place on q [T, num_q_heads, head_dim] and k [T, num_k_heads, head_dim]
// (heads contiguous within a token), by position lookup in table [max_position, rot_dim]: cos half, then sin half.
// Dimensions past rot_dim pass through. As Hugging Face: cos and sin rounded to T, x * cos + rotate_half(x) * sin.
template <typename T>
void rotary(T* q, int64_t q_token_stride, int64_t num_q_heads, T* k, int64_t k_token_stride, int64_t num_k_heads,
            int64_t head_dim, const int64_t* positions, const float* table, int64_t rot_dim, int64_t num_tokens) {
  const int64_t half = rot_dim / 2;
  parallel_for(num_tokens, num_tokens > 16, [&](int64_t t) {
    thread_local std::vector<float> cos_t, sin_t;  // this token's angles, rounded to T once for all its heads
    cos_t.resize(half);
    sin_t.resize(half);
    const float* angles = table + positions[t] * rot_dim;
    for (int64_t i = 0; i < half; ++i) {
      cos_t[i] = to_float(from_float<T>(angles[i]));
      sin_t[i] = to_float(from_float<T>(angles[half + i]));
    }
    auto rotate_heads = [&](T* base, int64_t heads) {
      for (int64_t head = 0; head < heads; ++head) {
        T* x = base + head * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
          const float a1 = to_float(from_float<T>(x1 * cos_t[i])), b1 = to_float(from_float<T>(-x2 * sin_t[i]));
          const float a2 = to_float(from_float<T>(x2 * cos_t[i])), b2 = to_float(from_float<T>(x1 * sin_t[i]));
          x[i] = from_float<T>(a1 + b1);
          x[i + half] = from_float<T>(a2 + b2);
        }
      }
    };
    rotate_heads(q + t * q_token_stride, num_q_heads);
    rotate_heads(k + t * k_token_stride, num_k_heads);
  });
}

// out[t, i] = silu(x[t, i]) * x[t, width + i] for x [T, 2 * width] (gate, then up).
template <typename T>
void silu_and_mul(T* out, const T* x, int64_t x_stride, int64_t num_rows, int64_t width) {
  parallel_for(num_rows, num_rows > 4, [&](int64_t row) {
    const T* gate = x + row * x_stride;
    const T* up = gate + width;
    T* out_row = out + row * width;
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) {
      const float g = to_float(gate[i]);
      const float e = exp_nonpositive(-std::fabs(g));  // exp(-|g|) never overflows
      const float sigmoid = (g >= 0.0f ? 1.0f : e) / (1.0f + e);
      out_row[i] = from_float<T>(to_float(from_float<T>(g * sigmoid)) * to_float(up[i]));
    }
  });
}

}  // namespace

#define TM_DISPATCH(dtype, call)                                        \
  switch (dtype) {                                                      \
    case 0: { using T = float; call; return 0; }                        \
    case 1: { using T = bf16; call; return 0; }                         \
    case 2: { using T = _Float16; call; return 0; }                     \
    default: return -1;                                                 \
  }

// The KV cache's element type C for the activations' T: the cache dtype code equals the dtype's (C = T), names a
// 16-bit float under float32 activations (`--kv-cache-dtype float16|bfloat16`: half the bytes to read), or fp8.
#define TM_CACHE_TYPES(cache_dtype, dtype, ...)                         \
  if (cache_dtype == dtype) { using C = T; __VA_ARGS__; return 0; }     \
  if constexpr (std::is_same_v<T, float>) {                             \
    if (cache_dtype == 1) { using C = bf16; __VA_ARGS__; return 0; }    \
    if (cache_dtype == 2) { using C = _Float16; __VA_ARGS__; return 0; } \
  }                                                                     \
  if (cache_dtype == 3) { using C = fp8e4m3; __VA_ARGS__; return 0; }   \
  if (cache_dtype == 4) { using C = fp8e5m2; __VA_ARGS__; return 0; }   \
  return -1;
#define TM_DISPATCH_KV(dtype, cache_dtype, ...)                                          \
  switch (dtype) {                                                                       \
    case 0: { using T = float; TM_CACHE_TYPES(cache_dtype, dtype, __VA_ARGS__) }         \
    case 1: { using T = bf16; TM_CACHE_TYPES(cache_dtype, dtype, __VA_ARGS__) }          \
    case 2: { using T = _Float16; TM_CACHE_TYPES(cache_dtype, dtype, __VA_ARGS__) }      \
    default: return -1;                                                                  \
  }

extern "C" {

int tm_omp_max_threads() { return omp_get_max_threads(); }

int tm_decode_attention(int dtype, int cache_dtype, void* out, const void* query, int64_t query_token_stride,
                        const void* k_cache, const void* v_cache, int64_t block_size, int64_t num_kv_heads,
                        int64_t num_heads, int64_t head_dim, const int32_t* block_tables, int64_t block_table_stride,
                        const int32_t* query_start_loc, const int32_t* seq_lens, int64_t num_seqs,
                        int64_t max_query_len, float scale, int64_t window, float k_scale, float v_scale) {
  TM_DISPATCH_KV(dtype, cache_dtype,
                 decode_attention_any<T, C>(static_cast<T*>(out), static_cast<const T*>(query), query_token_stride,
                                            static_cast<const C*>(k_cache), static_cast<const C*>(v_cache), block_size,
                                            num_kv_heads, num_heads, head_dim, block_tables, block_table_stride,
                                            query_start_loc, seq_lens, num_seqs, max_query_len, scale, window,
                                            k_scale, v_scale))
}

int tm_write_kv(int dtype, int cache_dtype, const void* key, int64_t key_token_stride, const void* value,
                int64_t value_token_stride, void* k_cache, void* v_cache, const int64_t* slots, int64_t num_tokens,
                int64_t row_size, float k_scale, float v_scale) {
  TM_DISPATCH_KV(dtype, cache_dtype,
                 write_kv<T, C>(static_cast<const T*>(key), key_token_stride, static_cast<const T*>(value),
                                value_token_stride, static_cast<C*>(k_cache), static_cast<C*>(v_cache), slots,
                                num_tokens, row_size, k_scale, v_scale))
}

// float32 <-> fp8 (fp8_dtype 3: e4m3fn, 4: e5m2) of n values, to fp8 when to_fp8 is set: the conversions the KV
// kernels use, exposed for the tests that hold them to torch's bit for bit.
int tm_fp8_convert(int fp8_dtype, int to_fp8, const void* in, void* out, int64_t n) {
  auto convert = [&](auto fp8) {
    using F = decltype(fp8);
    if (to_fp8) {
      for (int64_t i = 0; i < n; ++i) static_cast<F*>(out)[i] = from_float<F>(static_cast<const float*>(in)[i]);
    } else {  // 16 at a time as the attention kernel reads them, the rest one by one
      int64_t i = 0;
      for (; i + 16 <= n; i += 16) {
        const f32x16 v = load16(static_cast<const F*>(in) + i);
        std::memcpy(static_cast<float*>(out) + i, &v, sizeof v);
      }
      for (; i < n; ++i) static_cast<float*>(out)[i] = to_float(static_cast<const F*>(in)[i]);
    }
    return 0;
  };
  if (fp8_dtype == 3) return convert(fp8e4m3{});
  if (fp8_dtype == 4) return convert(fp8e5m2{});
  return -1;
}

int tm_rms_norm(int dtype, void* out, int64_t out_stride, void* residual_out, int64_t residual_out_stride,
                const void* x, int64_t x_stride, const void* residual, int64_t residual_stride, const void* weight,
                int64_t num_rows, int64_t hidden, float eps) {
  TM_DISPATCH(dtype, rms_norm<T>(static_cast<T*>(out), out_stride, static_cast<T*>(residual_out),
                                 residual_out_stride, static_cast<const T*>(x), x_stride,
                                 static_cast<const T*>(residual), residual_stride, static_cast<const T*>(weight),
                                 num_rows, hidden, eps))
}

int tm_rotary(int dtype, void* q, int64_t q_token_stride, int64_t num_q_heads, void* k, int64_t k_token_stride,
              int64_t num_k_heads, int64_t head_dim, const int64_t* positions, const float* table, int64_t rot_dim,
              int64_t num_tokens) {
  TM_DISPATCH(dtype, rotary<T>(static_cast<T*>(q), q_token_stride, num_q_heads, static_cast<T*>(k), k_token_stride,
                               num_k_heads, head_dim, positions, table, rot_dim, num_tokens))
}

// Structured outputs: logits[logit_rows[i], t] = -inf wherever bit t of bitmask row mask_rows[i] is clear (ids past
// the bitmask's width too). A bitmask row with no bit set is skipped (the scheduler handles that request).
int tm_apply_token_bitmask(float* logits, int64_t logits_row_stride, int64_t vocab, const uint32_t* bitmask,
                           int64_t words, const int64_t* mask_rows, const int64_t* logit_rows, int64_t num_rows) {
  const float ninf = -__builtin_inff();
  const int64_t covered = std::min(vocab, words * 32);
  for (int64_t i = 0; i < num_rows; ++i) {
    const uint32_t* mask = bitmask + mask_rows[i] * words;
    float* row = logits + logit_rows[i] * logits_row_stride;
    bool any = false;
    for (int64_t w = 0; w < words && !any; ++w) any = mask[w] != 0;
    if (!any) continue;
    for (int64_t w = 0; w * 32 < covered; ++w) {
      const uint32_t bits = mask[w];
      if (bits == 0xffffffffu) continue;
      const int64_t base = w * 32, end = std::min<int64_t>(base + 32, covered);
      for (int64_t t = base; t < end; ++t)
        if (!((bits >> (t - base)) & 1u)) row[t] = ninf;
    }
    for (int64_t t = covered; t < vocab; ++t) row[t] = ninf;
  }
  return 0;
}

int tm_silu_and_mul(int dtype, void* out, const void* x, int64_t x_stride, int64_t num_rows, int64_t width) {
  TM_DISPATCH(dtype, silu_and_mul<T>(static_cast<T*>(out), static_cast<const T*>(x), x_stride, num_rows, width))
}

}  // extern "C"
