// y[T, N] = x[T, K] @ W[N, K]^T with W kept in GGUF (llama.cpp) blocks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL,
// Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.
//
// As llama.cpp's vec_dot: each activation row is quantized once to int8 (per 32 values for the 32-wide types, per
// 256 for the k-quants, a float scale each, plus the sums of every 16 and 32 int8 values), and each weight block is
// unpacked to unsigned 8-bit integers and multiplied with those in integer arithmetic; the block's scale (and its min
// or its -8 / -32 offset, through the activation sums) is applied once per block. For batch > 1, a weight row's block
// is unpacked once and used against up to 4 activation rows, over a tile of rows small enough to stay in L1/L2, so a
// 32-token batch reads the weights from memory once, not 32 times. Threads split the output rows (OpenMP).
//
// tm_gguf_matmul_repacked is the same int8 matmul on weights repacked for it (the 32-wide types: Q4_0, Q4_1, Q5_0,
// Q5_1, Q8_0, IQ4_NL; llama.cpp's "repack" GEMM idea): each group of 8 output rows stores block b of its 8 rows
// together, their scales side by side and their quants interleaved in 4-byte groups (the layout is spelled out at
// `packed_rows` below; kernels/gguf_ops.py repacks). One VNNI vpdpbusd (AVX2: maddubs) of 32 quant bytes with a
// broadcast 4-byte group of one activation row then accumulates 8 rows' partial dot products at once (Q5's fifth bits,
// stored transposed, merged in by a shift and a mask per 32 bytes, IQ4_NL's values by a table shuffle), and a block's
// scales (and mins) are applied once per (block, activation row, 8 rows) by one 8-lane FMA, straight into the 8
// outputs: no horizontal sums. Each weight block is unpacked once for up to 8 activation rows (AVX2 Q8_0, IQ4_NL: 4).
// Same integer products as tm_gguf_matmul; only the float summation order differs. Rows past the last whole group of 8
// stay in the plain layout (the plain kernels). Q2_K, Q3_K and Q4_K have the same kind of layout (see
// `packed_segments`, `packed_q2_k_rows`, `packed_q4_k_rows`; Q3_K's quants recoded as 3-bit values): a sub-block's
// scale is applied once per 8 rows.
//
// tm_gguf_matmul_float is the float-activation alternative: no int8 rounding; each weight block is dequantized in
// registers exactly as gguf.quants does and multiplied with the float32 activations by FMA, summed in float32, with
// the same batching (see "the float-activation path" below).
//
// Instruction sets: the kernels below the `TM_GGUF_BODY` line are written once against a handful of vector ops and
// compiled several times, by including this file into itself, once per instruction set: a portable scalar version,
// AVX2+FMA (maddubs), AVX-512 VL+BW+VNNI (vpdpbusd / vpdpwssd on 256-bit vectors: two Q4_0 blocks per 512-bit
// vpdpbusd measured no faster on this Zen 4, which splits 512-bit operations in two) and AArch64 NEON (sdot where
// the CPU has dotprod). The x86 versions carry `#pragma GCC target`, so one library built for x86-64 runs on every
// x86 CPU and picks the best version with __builtin_cpu_supports; `tm_gguf_set_isa` forces a lower one (the tests
// run every available one). The NEON version has run only under qemu-aarch64, against the portable one, with and
// without dotprod (tests/kernels/gguf_neon_check.cpp), never on ARM hardware; its speed is unknown.
//
// Built by kernels/gguf_ops.py through kernels/cpu_ops.py's cached, private build; a plain C ABI on raw pointers.

#ifndef TM_GGUF_BODY

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#define TM_X86 1
#include <immintrin.h>
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#define TM_NEON 1
#include <arm_neon.h>
#endif

namespace {

// ggml_type values (gguf.GGMLQuantizationType)
enum QType : int {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20
};
enum Isa : int { ISA_SCALAR = 0, ISA_NEON = 1, ISA_AVX2 = 2, ISA_AVX512 = 3 };

constexpr bool is_k_quant(int qtype) { return qtype >= Q2_K && qtype <= Q6_K; }
constexpr int block_elems(int qtype) { return is_k_quant(qtype) ? 256 : 32; }
constexpr int block_bytes(int qtype) {
  switch (qtype) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case IQ4_NL: return 18;
    case Q2_K: return 84;
    case Q3_K: return 110;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
  }
}

// The types with the repacked layout (tm_gguf_matmul_repacked: the 32-wide ones, Q2_K, Q3_K and Q4_K), and the bytes
// before each block's 4-byte groups, moved in 2-byte pieces: the fp16 scale (and min); Q4_K's d, dmin and 12 bytes of
// 6-bit scales and mins (Q5_0 / Q5_1: the 32-bit word of fifth bits is their first group).
constexpr bool has_packed_layout(int qtype) {
  return qtype == Q4_0 || qtype == Q4_1 || qtype == Q5_0 || qtype == Q5_1 || qtype == Q8_0 || qtype == IQ4_NL ||
         qtype == Q2_K || qtype == Q3_K || qtype == Q4_K;
}
constexpr int packed_scale_bytes(int qtype) { return qtype == Q4_K ? 16 : qtype == Q4_1 || qtype == Q5_1 ? 4 : 2; }

// A repacked block of 8 rows is its plain blocks' byte ranges ("segments") one after the other, each with the 8 rows'
// bytes interleaved in pieces of `unit` bytes: piece p of row 0, of row 1, ..., of row 7, for p = 0, 1, ... For the
// 32-wide types and Q4_K: the packed_scale_bytes in 2-byte pieces, then the rest in 4-byte groups. Q2_K: d and dmin
// (2-byte pieces: the 8 d, then the 8 dmin), the 16 scale bytes one at a time (8 bytes a sub-block), the 64 quant
// bytes in 4-byte groups. Q3_K: d, the 12 scale bytes one at a time, then its 96 bytes of hmask and quants, recoded
// as 3-bit values (`q3_k_values_stored`), in 4-byte groups. Kept in step with gguf_ops._PACKED_SEGMENTS.
struct PackedSegment {
  int offset, length, unit;  // in the plain block
};
struct PackedSegments {
  PackedSegment segment[4];
  int count;
};
constexpr PackedSegments packed_segments(int qtype) {
  if (qtype == Q2_K) return {{{80, 4, 2}, {0, 16, 1}, {16, 64, 4}, {}}, 3};
  if (qtype == Q3_K) return {{{108, 2, 2}, {96, 12, 1}, {0, 96, 4}, {}}, 3};
  const int head = packed_scale_bytes(qtype);
  return {{{0, head, 2}, {head, block_bytes(qtype) - head, 4}, {}, {}}, 2};
}

// IQ4_NL's 16 weights (times its block scale), indexed by the 4-bit quant (ggml's kvalues_iq4nl).
alignas(16) constexpr int8_t kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                 1,    13,   25,  38,  53,  69,  89,  113};

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// IEEE half to float in integer arithmetic (the portable path; the SIMD paths use the hardware conversion).
inline float half_to_float_portable(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-08f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
  return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The eight 6-bit scales then the eight 6-bit mins of a Q4_K / Q5_K block from its 12 packed bytes (llama.cpp's
// get_scale_min_k4, done four at a time on 32-bit words as its vec_dot does).
inline void unpack_scales_mins_k4(const uint8_t* packed, uint8_t out[16]) {
  constexpr uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
  uint32_t u[4];
  std::memcpy(u, packed, 12);
  u[3] = ((u[2] >> 4) & kmask2) | (((u[1] >> 6) & kmask3) << 4);
  const uint32_t mins_low = u[1] & kmask1;
  u[1] = (u[2] & kmask2) | (((u[0] >> 6) & kmask3) << 4);
  u[2] = mins_low;
  u[0] &= kmask1;
  std::memcpy(out, u, 16);
}

// The sixteen 6-bit scales of a Q3_K block from its 12 packed bytes, minus their offset of 32 (ggml's
// dequantize_row_q3_K, on 32-bit words): scale g's low 4 bits are the low (g < 8) or high nibble of byte g % 8, its
// high 2 bits are bits 2 (g / 4) of byte 8 + g % 4.
inline void unpack_scales_q3_k(const uint8_t* packed, int8_t out[16]) {
  constexpr uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f;
  uint32_t u[4];
  std::memcpy(u, packed, 12);
  const uint32_t high = u[2];
  u[2] = ((u[0] >> 4) & kmask2) | (((high >> 4) & kmask1) << 4);
  u[3] = ((u[1] >> 4) & kmask2) | (((high >> 6) & kmask1) << 4);
  u[0] = (u[0] & kmask2) | ((high & kmask1) << 4);
  u[1] = (u[1] & kmask2) | (((high >> 2) & kmask1) << 4);
  std::memcpy(out, u, 16);
  for (int g = 0; g < 16; ++g) out[g] = static_cast<int8_t>(out[g] - 32);
}

// The activations quantized for one call: per row, K int8 values, a float scale per block of `block` values, the
// int8 sums of every 16 and every 32 values, and per block the scale times the block's int8 sum (`scaled_sums`, for
// the 32-wide types' offsets and mins).
struct Activations {
  const int8_t* q;
  const float* scale;
  const int16_t* sums16;
  const int16_t* sums32;
  const float* scaled_sums;
  const int32_t* bias128;  // for the 32-wide types (else null): -128 times each block's int8 sum
  int64_t K;
  int block;
  int64_t ldy;  // the output's row stride
  // For Q4_0 / Q4_1 (else null): the same int8 values with each pair of blocks b, b + 1 stored as the first 16 of b,
  // the first 16 of b + 1, the last 16 of b, the last 16 of b + 1 -- the order of two blocks' low then high nibbles.
  const int8_t* q_pairs;
  // Which gguf_matmul call these are (unique per call): a kernel that lays the activations out again for its own
  // use (packed_row_pairs, once per thread and call) knows from it whether its copy is still this call's.
  uint64_t call = 0;
  const int8_t* qrow(int64_t t) const { return q + t * K; }
  const int8_t* q_pairs_row(int64_t t) const { return q_pairs + t * K; }
  const float* scale_row(int64_t t) const { return scale + t * (K / block); }
  const int16_t* sums16_row(int64_t t) const { return sums16 + t * (K / 16); }
  const int16_t* sums32_row(int64_t t) const { return sums32 + t * (K / 32); }
  const float* scaled_sums_row(int64_t t) const { return scaled_sums + t * (K / block); }
  const int32_t* bias128_row(int64_t t) const { return bias128 + t * (K / block); }
};

// Round to nearest even of |v| < 2^22 by the float adder (llama.cpp's nearest_int): vectorizes on every ISA.
inline int32_t nearest_int(float v) {
  const float shifted = v + 12582912.0f;
  uint32_t bits;
  std::memcpy(&bits, &shifted, sizeof bits);
  return static_cast<int32_t>(bits & 0x007fffffu) - 0x00400000;
}

inline float load_activation(const float* x, int64_t i) { return x[i]; }
inline float load_activation(const uint16_t* x, int64_t i) { return bits_to_float(static_cast<uint32_t>(x[i]) << 16); }

// An instruction set's two halves: quantize activation rows [t_begin, t_end) of x (dtype 0 float32, 1 bfloat16)
// into the buffers of `act`; and compute the tile of output rows [row_begin, row_end) for all T activation rows,
// into y (row stride act.ldy).
using QuantizeFn = void (*)(int dtype, const void* x, int64_t ldx, int64_t t_begin, int64_t t_end,
                            const Activations& act);
using TileFn = void (*)(int qtype, const uint8_t* w, int64_t row_bytes, int64_t row_begin, int64_t row_end,
                        const Activations& act, int64_t T, float* y);
// The float-activation path: the tile of output rows [row_begin, row_end) for all T float32 activation rows of x
// (row stride ldx), into y (row stride ldy).
using FloatTileFn = void (*)(int qtype, const uint8_t* w, int64_t row_bytes, int64_t row_begin, int64_t row_end,
                             const float* x, int64_t ldx, int64_t K, int64_t T, float* y, int64_t ldy);
// The repacked layout (tm_gguf_matmul_repacked): groups [group_begin, group_end) of 8 output rows for all T rows.
using PackedTileFn = void (*)(int qtype, const uint8_t* w, int64_t row_bytes, int64_t group_begin, int64_t group_end,
                              const Activations& act, int64_t T, float* y);
// A number no earlier gguf_matmul call had (Activations::call).
inline uint64_t next_call_number() {
  static std::atomic<uint64_t> calls{0};
  return calls.fetch_add(1, std::memory_order_relaxed) + 1;
}

struct Kernels {
  QuantizeFn quantize;
  TileFn tile;
  FloatTileFn float_tile;
  PackedTileFn packed_tile;
};

// for i in [0, n): body(i), split over the OpenMP team when `parallel` and there is more than one thread, else
// inline: a one-thread OpenMP region costs ~0.4 us (libgomp sets up a team), ~200 matmuls a batch-1 decode step.
// (kernels/cpu_ops.cpp has the same helper: each library is built from its one source file.)
template <typename Body>
inline void parallel_for(int64_t n, bool parallel, Body&& body) {
  if (parallel && omp_get_max_threads() > 1) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) body(i);
  } else {
    for (int64_t i = 0; i < n; ++i) body(i);
  }
}

// Q5_0 / Q5_1 keep a row's 32-bit word of fifth bits transposed in the repacked layout: bit j of byte i holds element
// 4j + i's fifth bit and bit 4 + j element 16 + 4j + i's (the plain word: bit e, element e). Byte i of the word then
// lines up with byte i of every 4-byte group of quants (elements 4j + i in the low nibble, 16 + 4j + i in the high),
// and group j's fifth bits come out of the 8 rows' words by one shift and one mask each (`packed_weights`; a shuffle,
// a test and a select each in the plain order cost a quarter of a Q5_0 prefill's matmul time on AVX2).
inline uint32_t transposed_fifth_bits(uint32_t plain) {
  uint32_t out = 0;
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) {
      out |= ((plain >> (4 * j + i)) & 1u) << (8 * i + j);
      out |= ((plain >> (16 + 4 * j + i)) & 1u) << (8 * i + 4 + j);
    }
  return out;
}
inline uint32_t plain_fifth_bits(uint32_t transposed) {
  uint32_t out = 0;
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) {
      out |= ((transposed >> (8 * i + j)) & 1u) << (4 * j + i);
      out |= ((transposed >> (8 * i + 4 + j)) & 1u) << (16 + 4 * j + i);
    }
  return out;
}

// Q3_K keeps a block's 96 bytes of hmask and quants as 3-bit values in the repacked layout: element 128 n + 32 f + l
// has u_v = q + 4 in [0, 8) (q: ggml's signed 3-bit quant, its two low bits from the quants, the third from hmask;
// v = 4 n + f), and for l = 4 i + k the stored bytes 12 i + k, 12 i + 4 + k and 12 i + 8 + k are
//   A = u_0 | u_1 << 3 | (u_2 & 3) << 6,   B = u_3 | u_4 << 3 | (u_5 & 3) << 6,
//   C = u_6 | u_7 << 3 | (u_2 >> 2) << 6 | (u_5 >> 2) << 7.
// The repacked group interleaves them 8 rows to a 32-byte vector (A, B, C of each i), so the kernel takes u_0, u_3,
// u_6 with one mask, u_1, u_4, u_7 with a shift and a mask, u_2 and u_5 with five ops: 19 vector ops for the 8 values
// against 37 from ggml's bit planes (a shift and a mask for the low bits, two more and an or for the third bit).
inline void q3_k_values_stored(const uint8_t* plain, uint8_t* stored) {
  for (int l = 0; l < 32; ++l) {
    uint8_t u[8];
    for (int v = 0; v < 8; ++v)
      u[v] = static_cast<uint8_t>(((plain[32 + 32 * (v / 4) + l] >> (2 * (v % 4))) & 3) | (((plain[l] >> v) & 1) << 2));
    uint8_t* out = stored + 12 * (l / 4) + l % 4;
    out[0] = static_cast<uint8_t>(u[0] | u[1] << 3 | (u[2] & 3) << 6);
    out[4] = static_cast<uint8_t>(u[3] | u[4] << 3 | (u[5] & 3) << 6);
    out[8] = static_cast<uint8_t>(u[6] | u[7] << 3 | (u[2] >> 2) << 6 | (u[5] >> 2) << 7);
  }
}
inline void q3_k_values_plain(const uint8_t* stored, uint8_t* plain) {
  std::memset(plain, 0, 96);
  for (int l = 0; l < 32; ++l) {
    const uint8_t* in = stored + 12 * (l / 4) + l % 4;
    const int a = in[0], b = in[4], c = in[8];
    const int u[8] = {a & 7, (a >> 3) & 7, (a >> 6) | ((c >> 4) & 4), b & 7,
                      (b >> 3) & 7, (b >> 6) | ((c >> 5) & 4), c & 7, (c >> 3) & 7};
    for (int v = 0; v < 8; ++v) {
      plain[32 + 32 * (v / 4) + l] |= static_cast<uint8_t>((u[v] & 3) << (2 * (v % 4)));
      plain[l] |= static_cast<uint8_t>((u[v] >> 2) << v);
    }
  }
}

// A plain block as the repacked layout stores it before its bytes are moved (TO_STORED), or back: Q5_0 / Q5_1's word
// of fifth bits transposed (right after the scale, and min), Q3_K's hmask and quants as 3-bit values; the other
// types' bytes unchanged.
template <bool TO_STORED>
inline void recode_block(int qtype, const uint8_t* in, uint8_t* out) {
  const int bb = block_bytes(qtype);
  std::memcpy(out, in, bb);
  if (qtype == Q5_0 || qtype == Q5_1) {
    const int at = packed_scale_bytes(qtype);
    uint32_t word;
    std::memcpy(&word, in + at, sizeof word);
    word = TO_STORED ? transposed_fifth_bits(word) : plain_fifth_bits(word);
    std::memcpy(out + at, &word, sizeof word);
  } else if (qtype == Q3_K) {
    TO_STORED ? q3_k_values_stored(in, out) : q3_k_values_plain(in, out);
  }
}
constexpr int kMaxPackedBlockBytes = 144;  // Q4_K's

// Row r (< 8) of a block of a repacked group (`packed`, 8 blocks) between it and the plain block: out of the group
// into `plain`, or (TO_PACKED) from `plain` into its place in the group. With move_row, the only code that knows the
// layout's byte order besides gguf_ops._group_permutation (and _stored_bit_order) and the kernels' reads.
template <bool TO_PACKED>
void move_block(int qtype, uint8_t* packed, int r, uint8_t* plain) {
  uint8_t stored[kMaxPackedBlockBytes];
  if (TO_PACKED) recode_block<true>(qtype, plain, stored);
  const PackedSegments segments = packed_segments(qtype);
  for (int s = 0; s < segments.count; ++s) {
    const PackedSegment seg = segments.segment[s];
    for (int p = 0; p < seg.length; p += seg.unit) {
      uint8_t* in_group = packed + 8 * p + seg.unit * r;
      TO_PACKED ? std::memcpy(in_group, stored + seg.offset + p, seg.unit)
                : std::memcpy(stored + seg.offset + p, in_group, seg.unit);
    }
    packed += 8 * seg.length;
  }
  if (!TO_PACKED) recode_block<false>(qtype, stored, plain);
}

}  // namespace

// ---------------------------------------------------------------- the instruction-set versions

namespace tm_scalar {
#define TM_GGUF_BODY 1
#define TM_ISA_SCALAR 1
#include "gguf_cpu.cpp"  // this file, from its own directory
#undef TM_ISA_SCALAR
#undef TM_GGUF_BODY
}  // namespace tm_scalar

#if TM_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace tm_avx2 {
#define TM_GGUF_BODY 1
#define TM_ISA_X86 1
#include "gguf_cpu.cpp"  // this file, from its own directory
#undef TM_ISA_X86
#undef TM_GGUF_BODY
}  // namespace tm_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
namespace tm_avx512 {
#define TM_GGUF_BODY 1
#define TM_ISA_X86 1
#define TM_VNNI 1
#include "gguf_cpu.cpp"  // this file, from its own directory
#undef TM_VNNI
#undef TM_ISA_X86
#undef TM_GGUF_BODY
}  // namespace tm_avx512
#pragma GCC pop_options
#endif

#if TM_NEON
namespace tm_neon {
#define TM_GGUF_BODY 1
#define TM_ISA_NEON 1
#include "gguf_cpu.cpp"  // this file, from its own directory
#undef TM_ISA_NEON
#undef TM_GGUF_BODY
}  // namespace tm_neon
#endif

namespace {

bool isa_supported(int isa) {
  switch (isa) {
    case ISA_SCALAR: return true;
#if TM_NEON
    case ISA_NEON: return true;
#endif
#if TM_X86
    case ISA_AVX2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case ISA_AVX512:
      return isa_supported(ISA_AVX2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vnni");
#endif
    default: return false;
  }
}

int best_isa() {
  for (int isa : {ISA_AVX512, ISA_AVX2, ISA_NEON})
    if (isa_supported(isa)) return isa;
  return ISA_SCALAR;
}

int current_isa = -1;

int active_isa() {
  if (current_isa < 0) current_isa = best_isa();
  return current_isa;
}

Kernels kernels_for(int isa) {
  switch (isa) {
#if TM_X86
    case ISA_AVX512: return {tm_avx512::quantize_rows, tm_avx512::run_tile, tm_avx512::run_float_tile, tm_avx512::run_packed_tile};
    case ISA_AVX2: return {tm_avx2::quantize_rows, tm_avx2::run_tile, tm_avx2::run_float_tile, tm_avx2::run_packed_tile};
#endif
#if TM_NEON
    case ISA_NEON: return {tm_neon::quantize_rows, tm_neon::run_tile, tm_neon::run_float_tile, tm_neon::run_packed_tile};
#endif
    default: return {tm_scalar::quantize_rows, tm_scalar::run_tile, tm_scalar::run_float_tile, tm_scalar::run_packed_tile};
  }
}

}  // namespace

extern "C" {

int tm_gguf_isa_supported(int isa) { return isa_supported(isa) ? 1 : 0; }

int tm_gguf_isa() { return active_isa(); }

// Use instruction set `isa` (an Isa value) from now on; -1 restores the best one. Returns 0, or -1 if unsupported.
int tm_gguf_set_isa(int isa) {
  if (isa < 0) isa = best_isa();
  if (!isa_supported(isa)) return -1;
  current_isa = isa;
  return 0;
}

int tm_gguf_block_bytes(int qtype) { return block_bytes(qtype); }

}  // extern "C"

namespace {

int gguf_matmul(bool repacked, int qtype, int dtype, const void* x, int64_t ldx, const uint8_t* w, int64_t T,
                int64_t N, int64_t K, void* y, int64_t ldy) {
  if (block_bytes(qtype) == 0 || (dtype != 0 && dtype != 1)) return -1;
  if (repacked && !has_packed_layout(qtype)) return -1;
  const int block = block_elems(qtype);
  if (K % block != 0 || K <= 0) return -2;
  if (T <= 0 || N <= 0) return 0;
  const int64_t row_bytes = K / block * block_bytes(qtype);
  const int64_t groups = repacked ? N / 8 : 0;  // whole groups of 8 repacked rows; the rest are plain rows
  // Per-thread scratch kept between calls: decode calls are small, and allocating costs as much as a small matmul.
  thread_local std::vector<int8_t> q, q_pairs;
  thread_local std::vector<float> scale, scaled_sums, out_f32;
  thread_local std::vector<int16_t> sums16, sums32;
  thread_local std::vector<int32_t> bias128;
  q.resize(static_cast<size_t>(T * K));
  // the pair order serves only the plain Q4_0 / Q4_1 kernels
  const bool nibble_pairs = (qtype == Q4_0 || qtype == Q4_1) && groups * 8 < N;
  if (nibble_pairs) q_pairs.resize(q.size());
  scale.resize(static_cast<size_t>(T * (K / block)));
  scaled_sums.resize(scale.size());
  sums16.resize(static_cast<size_t>(T * (K / 16)));
  sums32.resize(static_cast<size_t>(T * (K / 32)));
  if (block == 32) bias128.resize(scale.size());
  if (dtype != 0) out_f32.resize(static_cast<size_t>(T * N));
  float* out = dtype == 0 ? static_cast<float*>(y) : out_f32.data();
  const int64_t ld_out = dtype == 0 ? ldy : N;
  const Activations act{q.data(), scale.data(), sums16.data(),  sums32.data(),
                       scaled_sums.data(), block == 32 ? bias128.data() : nullptr,
                       K, block, ld_out, nibble_pairs ? q_pairs.data() : nullptr, next_call_number()};
  const Kernels kernels = kernels_for(active_isa());
  if (T * K < (int64_t{1} << 16)) {
    kernels.quantize(dtype, x, ldx, 0, T, act);
  } else {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) kernels.quantize(dtype, x, ldx, t, t + 1, act);
  }
  if (repacked) {
    // A tile of groups shares each activation chunk from L1 at prefill; one group per tile up to 8 rows.
    const int64_t tile = T <= 8 ? 1 : 4;
    const int64_t tiles = (groups + tile - 1) / tile;
    const int64_t plain = groups * 8;
    parallel_for(tiles + 1, N * row_bytes >= (int64_t{1} << 16), [&](int64_t i) {
      if (i < tiles) kernels.packed_tile(qtype, w, row_bytes, i * tile, std::min(groups, (i + 1) * tile), act, T, out);
      else if (plain < N) kernels.tile(qtype, w, row_bytes, plain, N, act, T, out);
    });
  } else {
    // Rows per tile: enough to share the unpacked blocks across token groups from L1/L2, few enough that every
    // thread gets a fair share at batch 1. The result of a tile goes to `out` as [T, ld_out] rows.
    const int64_t tile = T <= 4 ? 4 : 16;
    const int64_t tiles = (N + tile - 1) / tile;
    // Below ~64 KiB of weights a parallel region costs more than it saves.
    parallel_for(tiles, N * row_bytes >= (int64_t{1} << 16), [&](int64_t i) {
      const int64_t begin = i * tile, end = std::min(N, begin + tile);
      kernels.tile(qtype, w, row_bytes, begin, end, act, T, out);
    });
  }
  if (dtype == 1) {
    uint16_t* yb = static_cast<uint16_t*>(y);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < N; ++n) {
        uint32_t bits;
        const float v = out_f32[t * N + n];
        std::memcpy(&bits, &v, sizeof bits);
        if ((bits & 0x7fffffffu) > 0x7f800000u) {
          yb[t * ldy + n] = static_cast<uint16_t>((bits >> 16) | 0x40u);
        } else {
          bits += 0x7fffu + ((bits >> 16) & 1u);
          yb[t * ldy + n] = static_cast<uint16_t>(bits >> 16);
        }
      }
  }
  return 0;
}

// Row r of a repacked group between the group and a plain row of row_bytes bytes, block by block (move_block).
template <bool TO_PACKED>
void move_row(int qtype, uint8_t* group, int64_t row_bytes, int r, uint8_t* plain_row) {
  const int bb = block_bytes(qtype);
  for (int64_t b = 0; b < row_bytes / bb; ++b)
    move_block<TO_PACKED>(qtype, group + b * 8 * bb, r, plain_row + b * bb);
}

// The 8 rows of a repacked group (`src`) back in the plain layout: dst gets 8 * row_bytes bytes.
void unpack_group(int qtype, const uint8_t* src, int64_t row_bytes, uint8_t* dst) {
  for (int r = 0; r < 8; ++r) move_row<false>(qtype, const_cast<uint8_t*>(src), row_bytes, r, dst + r * row_bytes);
}

}  // namespace

extern "C" {

// y[t * ldy + n] = sum_k x[t * ldx + k] * W[n, k] for t < T, n < N; x is float32 (dtype 0) or bfloat16 (dtype 1), so
// is y; W's rows are `K / block_elems * block_bytes` bytes apart. Returns 0, -1 for an unsupported type or dtype,
// -2 for a K that is not a whole number of blocks.
int tm_gguf_matmul(int qtype, int dtype, const void* x, int64_t ldx, const uint8_t* w, int64_t T, int64_t N,
                   int64_t K, void* y, int64_t ldy) {
  return gguf_matmul(false, qtype, dtype, x, ldx, w, T, N, K, y, ldy);
}

// tm_gguf_matmul on weights of a type with the packed layout (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) whose first N / 8 * 8 rows are in the repacked layout (groups of 8
// rows, each group the same bytes as its 8 plain rows, reordered: see `packed_rows`) and whose last N % 8 rows are
// plain. Same arguments and returns (-1 for the other types too).
int tm_gguf_matmul_repacked(int qtype, int dtype, const void* x, int64_t ldx, const uint8_t* w, int64_t T, int64_t N,
                            int64_t K, void* y, int64_t ldy) {
  return gguf_matmul(true, qtype, dtype, x, ldx, w, T, N, K, y, ldy);
}

// The N x K weight `src` (plain blocks) in the repacked layout into `dst` (as many bytes; not overlapping src): the
// first N / 8 * 8 rows reordered within their groups of 8, the rest copied. Returns 0, or -1 / -2 as tm_gguf_matmul.
int tm_gguf_repack(int qtype, const uint8_t* src, int64_t N, int64_t K, uint8_t* dst) {
  if (!has_packed_layout(qtype)) return -1;
  if (K % block_elems(qtype) != 0 || K <= 0) return -2;
  const int64_t row_bytes = K / block_elems(qtype) * block_bytes(qtype), groups = N / 8;
  for (int64_t g = 0; g < groups; ++g)
    for (int r = 0; r < 8; ++r)
      move_row<true>(qtype, dst + g * 8 * row_bytes, row_bytes, r, const_cast<uint8_t*>(src) + (g * 8 + r) * row_bytes);
  const int64_t plain = groups * 8 * row_bytes;
  if (groups * 8 < N) std::memcpy(dst + plain, src + plain, static_cast<size_t>((N - groups * 8) * row_bytes));
  return 0;
}

// Rows ids[0..count) of the N x K repacked weight `w` as plain blocks into dst (count rows). Returns 0, -1 / -2 as
// tm_gguf_repack, or -3 for an id outside [0, N).
int tm_gguf_unpack_rows(int qtype, const uint8_t* w, int64_t N, int64_t K, const int64_t* ids, int64_t count,
                        uint8_t* dst) {
  if (!has_packed_layout(qtype)) return -1;
  if (K % block_elems(qtype) != 0 || K <= 0) return -2;
  const int64_t row_bytes = K / block_elems(qtype) * block_bytes(qtype), whole = N / 8 * 8;
  for (int64_t i = 0; i < count; ++i)
    if (ids[i] < 0 || ids[i] >= N) return -3;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t id = ids[i];
    uint8_t* row = dst + i * row_bytes;
    if (id < whole)
      move_row<false>(qtype, const_cast<uint8_t*>(w) + id / 8 * 8 * row_bytes, row_bytes, static_cast<int>(id % 8), row);
    else
      std::memcpy(row, w + id * row_bytes, static_cast<size_t>(row_bytes));
  }
  return 0;
}

// ---------------------------------------------------------------- for scripts/bench_gguf_gemv.py
// The bandwidth bound in the same library and thread as the kernels: the 64-bit sum of `bytes` bytes (a multiple of
// 64) read once in order, eight independent accumulators so the adds never wait on each other.
uint64_t tm_gguf_stream_sum(const uint8_t* p, int64_t bytes) {
  uint64_t acc[8] = {};
  for (int64_t i = 0; i + 64 <= bytes; i += 64) {
    uint64_t words[8];
    std::memcpy(words, p + i, 64);
    for (int j = 0; j < 8; ++j) acc[j] += words[j];
  }
  return acc[0] + acc[1] + acc[2] + acc[3] + acc[4] + acc[5] + acc[6] + acc[7];
}

// The bound as the fastest of several read loops (`read_sum` in each instruction set's version): `bytes` bytes read
// as `streams` (1, 2, 4 or 8) parts side by side, prefetching `prefetch` bytes ahead of each where > 0, with the loads
// of instruction set `isa`. Returns the 64-bit lane sum, or 0 for an unsupported isa (the sum of real data is not 0).
uint64_t tm_gguf_read_sum(int isa, const uint8_t* p, int64_t bytes, int streams, int64_t prefetch) {
  if (!isa_supported(isa)) return 0;
  switch (isa) {
#if TM_X86
    case ISA_AVX512: return tm_avx512::read_sum(p, bytes, streams, prefetch);
    case ISA_AVX2: return tm_avx2::read_sum(p, bytes, streams, prefetch);
#endif
#if TM_NEON
    case ISA_NEON: return tm_neon::read_sum(p, bytes, streams, prefetch);
#endif
    default: return tm_scalar::read_sum(p, bytes, streams, prefetch);
  }
}

// `calls` int8 matmuls of the T x K activations x (float32) with weights[c % copies] (each N x K, plain or
// repacked) into y, back to back: the kernels' time without a Python call per matmul. Returns tm_gguf_matmul's code.
int tm_gguf_matmul_cycle(int qtype, int repacked, const float* x, const uint8_t* const* weights, int64_t copies,
                         int64_t calls, int64_t T, int64_t N, int64_t K, float* y) {
  for (int64_t c = 0; c < calls; ++c) {
    const int status = gguf_matmul(repacked != 0, qtype, 0, x, K, weights[c % copies], T, N, K, y, N);
    if (status != 0) return status;
  }
  return 0;
}

// The float-activation version of tm_gguf_matmul: y[t * ldy + n] = sum_k x[t * ldx + k] * W[n, k] with x and y
// float32, each weight dequantized in registers exactly as gguf.quants does and multiplied with the float
// activations by FMA, summed in float32 -- the dequantized-weight matmul up to float summation order. Same returns.
int tm_gguf_matmul_float(int qtype, const float* x, int64_t ldx, const uint8_t* w, int64_t T, int64_t N, int64_t K,
                         float* y, int64_t ldy) {
  if (block_bytes(qtype) == 0) return -1;
  const int block = block_elems(qtype);
  if (K % block != 0 || K <= 0) return -2;
  if (T <= 0 || N <= 0) return 0;
  const int64_t row_bytes = K / block * block_bytes(qtype);
  const Kernels kernels = kernels_for(active_isa());
  const int64_t tile = T <= 4 ? 4 : 16;  // as tm_gguf_matmul
  const int64_t tiles = (N + tile - 1) / tile;
  parallel_for(tiles, N * row_bytes >= (int64_t{1} << 16), [&](int64_t i) {
    const int64_t begin = i * tile, end = std::min(N, begin + tile);
    kernels.float_tile(qtype, w, row_bytes, begin, end, x, ldx, K, T, y, ldy);
  });
  return 0;
}

// tm_gguf_matmul_float on weights laid out as tm_gguf_matmul_repacked's: each group of 8 rows is put back in the plain
// layout in a per-thread buffer, then multiplied as there (the layout serves the int8 path; this keeps the float mode
// exact on repacked weights at the cost of a byte shuffle). Same returns (-1 for the types without the layout).
int tm_gguf_matmul_float_repacked(int qtype, const float* x, int64_t ldx, const uint8_t* w, int64_t T, int64_t N,
                                  int64_t K, float* y, int64_t ldy) {
  if (!has_packed_layout(qtype)) return -1;
  const int block = block_elems(qtype);
  if (K % block != 0 || K <= 0) return -2;
  if (T <= 0 || N <= 0) return 0;
  const int64_t row_bytes = K / block * block_bytes(qtype), groups = N / 8;
  const Kernels kernels = kernels_for(active_isa());
  parallel_for(groups + 1, N * row_bytes >= (int64_t{1} << 16), [&](int64_t g) {
    if (g < groups) {
      thread_local std::vector<uint8_t> plain;
      plain.resize(static_cast<size_t>(8 * row_bytes));
      unpack_group(qtype, w + g * 8 * row_bytes, row_bytes, plain.data());
      kernels.float_tile(qtype, plain.data(), row_bytes, 0, 8, x, ldx, K, T, y + g * 8, ldy);
    } else if (groups * 8 < N) {
      kernels.float_tile(qtype, w, row_bytes, groups * 8, N, x, ldx, K, T, y, ldy);
    }
  });
  return 0;
}

}  // extern "C"

#else  // TM_GGUF_BODY: the kernels, once per instruction set, inside that set's namespace

// ---------------------------------------------------------------- vector ops
// U8: 32 unsigned bytes (weights, in element order). I32: int32 partial sums whose lanes add up to the dot product.
// F32: float partial sums. Scales16: two int16 scales, for the first and the second 16 bytes of a U8.

#if TM_ISA_X86
using U8 = __m256i;
using I32 = __m256i;
using F32 = __m256;
using Scales16 = __m256i;

inline float half_to_float(const uint8_t* p) { return _cvtsh_ss(load_u16(p)); }
inline U8 load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline U8 nibbles16(const uint8_t* p) {  // 16 bytes -> their 16 low nibbles then their 16 high nibbles
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(q), _mm_srli_epi16(q, 4), 1);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}
inline U8 low4(U8 v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline U8 high4(U8 v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
// ((v >> S) & M) << L per byte (M << L stays within the byte), as one 16-bit shift by S - L and one mask: the bits a
// 16-bit shift brings in from the neighbouring byte land outside M << L, since the field lies within its byte.
template <int S, int M, int L>
inline U8 field(U8 v) {
  static_assert((M << L) < 256, "the field must stay within its byte");
  __m256i r = v;
  if constexpr (S > L) r = _mm256_srli_epi16(v, S - L);
  if constexpr (S < L) r = _mm256_slli_epi16(v, L - S);
  return _mm256_and_si256(r, _mm256_set1_epi8(static_cast<char>(M << L)));
}
inline U8 or8(U8 a, U8 b) { return _mm256_or_si256(a, b); }
// byte i = V where bit i of the 32-bit little-endian word at p is set, else 0 (Q5_0 / Q5_1's fifth bits)
template <int V>
inline U8 bit_bytes(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, sizeof bits);
#if TM_VNNI
  return _mm256_maskz_mov_epi8(bits, _mm256_set1_epi8(static_cast<char>(V)));
#else
  // each byte gets the byte of the word holding its bit, every bit but that one set, then compares to all ones
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i others = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(others, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(static_cast<char>(V)));
#endif
}
// byte i = table[idx[i]] for indices < 16 (IQ4_NL's non-linear weights)
inline U8 lookup16(const int8_t* table, U8 idx) {
  return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(table))), idx);
}
inline I32 izero() { return _mm256_setzero_si256(); }
inline F32 fzero() { return _mm256_setzero_ps(); }
inline I32 iadd(I32 a, I32 b) { return _mm256_add_epi32(a, b); }
// acc + sum u[i] * x[i], u < 128 (maddubs cannot saturate: 2 * 127 * 128 < 32768)
inline I32 dot(I32 acc, U8 u, const int8_t* x) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
#if TM_VNNI
  return _mm256_dpbusd_epi32(acc, u, xv);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, xv), _mm256_set1_epi16(1)));
#endif
}
// acc + sum w[i] * x[i] for signed bytes w (the sign moves onto x; |x| <= 127 so negating it is exact)
inline I32 dot_signed(I32 acc, U8 w, const int8_t* x) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i aw = _mm256_sign_epi8(w, w), sx = _mm256_sign_epi8(xv, w);
#if TM_VNNI
  return _mm256_dpbusd_epi32(acc, aw, sx);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1)));
#endif
}
// acc + lo * sum_{i<16} u[i] x[i] + hi * sum_{i>=16} u[i] x[i], u < 128
inline I32 dot_scaled(I32 acc, U8 u, const int8_t* x, Scales16 s) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i pairs = _mm256_maddubs_epi16(u, xv);
#if TM_VNNI
  return _mm256_dpwssd_epi32(acc, pairs, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, s));
#endif
}
// 8 scales as int16, in both 128-bit halves; pick<LO, HI> makes the Scales16 of scales LO and HI (one shuffle).
using ScaleVec = __m256i;
inline ScaleVec load_scales(const uint8_t* p) {
  return _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline ScaleVec load_scales(const int8_t* p) {
  return _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
template <int LO, int HI>
inline Scales16 pick(ScaleVec v) {
  constexpr char l0 = 2 * LO, l1 = 2 * LO + 1, h0 = 2 * HI, h1 = 2 * HI + 1;
  return _mm256_shuffle_epi8(v, _mm256_setr_epi8(l0, l1, l0, l1, l0, l1, l0, l1, l0, l1, l0, l1, l0, l1, l0, l1,
                                                 h0, h1, h0, h1, h0, h1, h0, h1, h0, h1, h0, h1, h0, h1, h0, h1));
}
// sum_j m[j] * s[j] for 16 signed bytes m and 16 int16 s
inline int32_t dot16(const int8_t* m, const int16_t* s) {
  const __m256i p = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m))),
                                      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
  __m128i r = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
  r = _mm_add_epi32(r, _mm_unpackhi_epi64(r, r));
  r = _mm_add_epi32(r, _mm_shuffle_epi32(r, 1));
  return _mm_cvtsi128_si32(r);
}
inline F32 fma_i32(F32 acc, I32 v, float s) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(s), acc); }
// Bytes16: a k-quant block's 16 sub-block scales (or 8 scales and 8 mins) as signed bytes, built in a register from
// the block's bytes (through memory they cost a store-forwarding stall per block: measured 2.5x on Q3_K).
using Bytes16 = __m128i;
inline Bytes16 bytes16(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) {
  return _mm_setr_epi32(static_cast<int>(w0), static_cast<int>(w1), static_cast<int>(w2), static_cast<int>(w3));
}
inline Bytes16 load_bytes16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
template <int S>  // (v >> S) & 15 per byte
inline Bytes16 nibbles_of(Bytes16 v) { return _mm_and_si128(S ? _mm_srli_epi16(v, S) : v, _mm_set1_epi8(0x0F)); }
inline Bytes16 minus(Bytes16 v, int k) { return _mm_sub_epi8(v, _mm_set1_epi8(static_cast<char>(k))); }
template <int HALF>  // bytes 8 HALF .. 8 HALF + 7 as a ScaleVec
inline ScaleVec scale_vec(Bytes16 v) { return _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(HALF ? _mm_srli_si128(v, 8) : v)); }
// sum_i v[i] * s[i] over the 16 bytes (COUNT = 16) or bytes 8..15 (COUNT = 8) against int16 s
template <int COUNT>
inline int32_t dot_bytes(Bytes16 v, const int16_t* s) {
  __m128i r;
  if constexpr (COUNT == 16) {
    const __m256i p = _mm256_madd_epi16(_mm256_cvtepi8_epi16(v), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
    r = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
  } else {
    r = _mm_madd_epi16(_mm_cvtepi8_epi16(_mm_srli_si128(v, 8)), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  }
  r = _mm_add_epi32(r, _mm_unpackhi_epi64(r, r));
  r = _mm_add_epi32(r, _mm_shuffle_epi32(r, 1));
  return _mm_cvtsi128_si32(r);
}
inline float hsum(F32 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}
inline I32 isub(I32 a, I32 b) { return _mm256_sub_epi32(a, b); }
template <int SHIFT>
inline I32 ishl(I32 v) { return _mm256_slli_epi32(v, SHIFT); }
// dot16 and dot_bytes with the sum left in the lanes: the k-quants fold it into their block sums (one horizontal sum
// per row, not one per block)
inline I32 dot16_lanes(const int8_t* m, const int16_t* s) {
  return _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m))),
                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
}
template <int COUNT>
inline I32 dot_bytes_lanes(Bytes16 v, const int16_t* s) {
  if constexpr (COUNT == 16)
    return _mm256_madd_epi16(_mm256_cvtepi8_epi16(v), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
  else
    return _mm256_zextsi128_si256(
        _mm_madd_epi16(_mm_cvtepi8_epi16(_mm_srli_si128(v, 8)), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s))));
}
// u + V in the bytes whose bit BIT of `bits` is set (BIT < 8; u + V < 256): a k-quant's high bit merged into its low
// ones (one mask test and one masked add on AVX-512, a shift and a mask and an or on AVX2)
template <int BIT, int V>
inline U8 add_bit(U8 u, U8 bits) {
#if TM_VNNI
  return _mm256_mask_add_epi8(u, _mm256_test_epi8_mask(bits, _mm256_set1_epi8(static_cast<char>(1 << BIT))), u,
                              _mm256_set1_epi8(static_cast<char>(V)));
#else
  constexpr int kShift = __builtin_ctz(V);
  return _mm256_or_si256(u, field<BIT, 1, kShift>(bits));
#endif
}

#elif TM_ISA_NEON
struct U8 {
  uint8x16_t lo, hi;
};
using I32 = int32x4_t;
using F32 = float32x4_t;
struct Scales16 {
  int lo, hi;
};

inline float half_to_float(const uint8_t* p) {
  __fp16 h;
  std::memcpy(&h, p, sizeof h);
  return static_cast<float>(h);
}
inline U8 load32(const uint8_t* p) { return U8{vld1q_u8(p), vld1q_u8(p + 16)}; }
inline U8 nibbles16(const uint8_t* p) {
  const uint8x16_t q = vld1q_u8(p);
  return U8{vandq_u8(q, vdupq_n_u8(0x0F)), vshrq_n_u8(q, 4)};
}
inline U8 low4(U8 v) { return U8{vandq_u8(v.lo, vdupq_n_u8(0x0F)), vandq_u8(v.hi, vdupq_n_u8(0x0F))}; }
inline U8 high4(U8 v) { return U8{vshrq_n_u8(v.lo, 4), vshrq_n_u8(v.hi, 4)}; }
template <int S>
inline uint8x16_t shift_right(uint8x16_t v) {
  if constexpr (S == 0) return v; else return vshrq_n_u8(v, S);
}
template <int S, int M, int L>
inline U8 field(U8 v) {
  const uint8x16_t m = vdupq_n_u8(M);
  return U8{vshlq_n_u8(vandq_u8(shift_right<S>(v.lo), m), L), vshlq_n_u8(vandq_u8(shift_right<S>(v.hi), m), L)};
}
inline U8 or8(U8 a, U8 b) { return U8{vorrq_u8(a.lo, b.lo), vorrq_u8(a.hi, b.hi)}; }
template <int V>
inline U8 bit_bytes(const uint8_t* p) {
  const uint8x16_t select = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  const uint8x16_t lo = vcombine_u8(vdup_n_u8(p[0]), vdup_n_u8(p[1]));
  const uint8x16_t hi = vcombine_u8(vdup_n_u8(p[2]), vdup_n_u8(p[3]));
  const uint8x16_t value = vdupq_n_u8(V);
  return U8{vandq_u8(vtstq_u8(lo, select), value), vandq_u8(vtstq_u8(hi, select), value)};
}
inline U8 lookup16(const int8_t* table, U8 idx) {
  const int8x16_t t = vld1q_s8(table);
  return U8{vreinterpretq_u8_s8(vqtbl1q_s8(t, idx.lo)), vreinterpretq_u8_s8(vqtbl1q_s8(t, idx.hi))};
}
inline I32 izero() { return vdupq_n_s32(0); }
inline F32 fzero() { return vdupq_n_f32(0.0f); }
inline I32 iadd(I32 a, I32 b) { return vaddq_s32(a, b); }
// acc + sum a[i] * b[i] over 16 signed bytes (|a * b| <= 128 * 127, so two products fit an int16)
inline I32 dot16(I32 acc, int8x16_t a, int8x16_t b) {
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(acc, a, b);
#else
  int16x8_t p = vmull_s8(vget_low_s8(a), vget_low_s8(b));
  p = vmlal_s8(p, vget_high_s8(a), vget_high_s8(b));
  return vpadalq_s16(acc, p);
#endif
}
// The unsigned weights are < 128 here, so they are the same numbers read as signed bytes.
inline I32 dot(I32 acc, U8 u, const int8_t* x) {
  acc = dot16(acc, vreinterpretq_s8_u8(u.lo), vld1q_s8(x));
  return dot16(acc, vreinterpretq_s8_u8(u.hi), vld1q_s8(x + 16));
}
inline I32 dot_signed(I32 acc, U8 w, const int8_t* x) { return dot(acc, w, x); }
inline I32 dot_scaled(I32 acc, U8 u, const int8_t* x, Scales16 s) {
  acc = vmlaq_n_s32(acc, dot16(vdupq_n_s32(0), vreinterpretq_s8_u8(u.lo), vld1q_s8(x)), s.lo);
  return vmlaq_n_s32(acc, dot16(vdupq_n_s32(0), vreinterpretq_s8_u8(u.hi), vld1q_s8(x + 16)), s.hi);
}
struct ScaleVec {
  int v[8];
};
template <typename B>
inline ScaleVec load_scales(const B* p) {
  ScaleVec r;
  for (int i = 0; i < 8; ++i) r.v[i] = p[i];
  return r;
}
template <int LO, int HI>
inline Scales16 pick(const ScaleVec& v) { return Scales16{v.v[LO], v.v[HI]}; }
inline int32_t dot16(const int8_t* m, const int16_t* s) {
  const int8x16_t mv = vld1q_s8(m);
  const int16x8_t lo = vmovl_s8(vget_low_s8(mv)), hi = vmovl_s8(vget_high_s8(mv));
  const int16x8_t s0 = vld1q_s16(s), s1 = vld1q_s16(s + 8);
  int32x4_t r = vmull_s16(vget_low_s16(lo), vget_low_s16(s0));
  r = vmlal_s16(r, vget_high_s16(lo), vget_high_s16(s0));
  r = vmlal_s16(r, vget_low_s16(hi), vget_low_s16(s1));
  r = vmlal_s16(r, vget_high_s16(hi), vget_high_s16(s1));
  return vaddvq_s32(r);
}
inline F32 fma_i32(F32 acc, I32 v, float s) { return vfmaq_n_f32(acc, vcvtq_f32_s32(v), s); }
inline float hsum(F32 v) { return vaddvq_f32(v); }
inline I32 isub(I32 a, I32 b) { return vsubq_s32(a, b); }
template <int SHIFT>
inline I32 ishl(I32 v) { return vshlq_n_s32(v, SHIFT); }
inline I32 from_int(int32_t v) { return vsetq_lane_s32(v, vdupq_n_s32(0), 0); }

#else  // portable scalar
struct U8 {
  uint8_t v[32];
};
using I32 = int32_t;
using F32 = float;
struct Scales16 {
  int lo, hi;
};

inline float half_to_float(const uint8_t* p) { return half_to_float_portable(load_u16(p)); }
inline U8 load32(const uint8_t* p) {
  U8 r;
  std::memcpy(r.v, p, 32);
  return r;
}
inline U8 nibbles16(const uint8_t* p) {
  U8 r;
  for (int i = 0; i < 16; ++i) {
    r.v[i] = p[i] & 0x0F;
    r.v[i + 16] = p[i] >> 4;
  }
  return r;
}
inline U8 low4(U8 v) {
  for (auto& b : v.v) b &= 0x0F;
  return v;
}
inline U8 high4(U8 v) {
  for (auto& b : v.v) b >>= 4;
  return v;
}
template <int S, int M, int L>
inline U8 field(U8 v) {
  for (auto& b : v.v) b = static_cast<uint8_t>(((b >> S) & M) << L);
  return v;
}
inline U8 or8(U8 a, U8 b) {
  for (int i = 0; i < 32; ++i) a.v[i] |= b.v[i];
  return a;
}
template <int V>
inline U8 bit_bytes(const uint8_t* p) {
  U8 r;
  for (int i = 0; i < 32; ++i) r.v[i] = static_cast<uint8_t>(((p[i / 8] >> (i % 8)) & 1) * V);
  return r;
}
inline U8 lookup16(const int8_t* table, U8 idx) {
  for (auto& b : idx.v) b = static_cast<uint8_t>(table[b]);
  return idx;
}
inline I32 izero() { return 0; }
inline F32 fzero() { return 0.0f; }
inline I32 iadd(I32 a, I32 b) { return a + b; }
inline I32 dot(I32 acc, U8 u, const int8_t* x) {
  for (int i = 0; i < 32; ++i) acc += static_cast<int32_t>(u.v[i]) * x[i];
  return acc;
}
inline I32 dot_signed(I32 acc, U8 w, const int8_t* x) {
  for (int i = 0; i < 32; ++i) acc += static_cast<int32_t>(static_cast<int8_t>(w.v[i])) * x[i];
  return acc;
}
inline I32 dot_scaled(I32 acc, U8 u, const int8_t* x, Scales16 s) {
  int32_t lo = 0, hi = 0;
  for (int i = 0; i < 16; ++i) lo += static_cast<int32_t>(u.v[i]) * x[i];
  for (int i = 16; i < 32; ++i) hi += static_cast<int32_t>(u.v[i]) * x[i];
  return acc + s.lo * lo + s.hi * hi;
}
struct ScaleVec {
  int v[8];
};
template <typename B>
inline ScaleVec load_scales(const B* p) {
  ScaleVec r;
  for (int i = 0; i < 8; ++i) r.v[i] = p[i];
  return r;
}
template <int LO, int HI>
inline Scales16 pick(const ScaleVec& v) { return Scales16{v.v[LO], v.v[HI]}; }
inline int32_t dot16(const int8_t* m, const int16_t* s) {
  int32_t r = 0;
  for (int i = 0; i < 16; ++i) r += m[i] * s[i];
  return r;
}
inline F32 fma_i32(F32 acc, I32 v, float s) { return acc + static_cast<float>(v) * s; }
inline float hsum(F32 v) { return v; }
inline I32 isub(I32 a, I32 b) { return a - b; }
template <int SHIFT>
inline I32 ishl(I32 v) { return static_cast<int32_t>(static_cast<uint32_t>(v) << SHIFT); }
inline I32 from_int(int32_t v) { return v; }
#endif

#if !TM_ISA_X86
// Bytes16 (see the x86 version) in plain arrays: NEON's ScaleVec is one too.
struct Bytes16 {
  int8_t v[16];
};
inline Bytes16 bytes16(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) {
  const uint32_t words[4] = {w0, w1, w2, w3};
  Bytes16 r;
  std::memcpy(r.v, words, 16);
  return r;
}
inline Bytes16 load_bytes16(const uint8_t* p) {
  Bytes16 r;
  std::memcpy(r.v, p, 16);
  return r;
}
template <int S>
inline Bytes16 nibbles_of(Bytes16 v) {
  for (auto& b : v.v) b = static_cast<int8_t>((static_cast<uint8_t>(b) >> S) & 15);
  return v;
}
inline Bytes16 minus(Bytes16 v, int k) {
  for (auto& b : v.v) b = static_cast<int8_t>(b - k);
  return v;
}
template <int HALF>
inline ScaleVec scale_vec(const Bytes16& v) { return load_scales(v.v + 8 * HALF); }
template <int COUNT>
inline int32_t dot_bytes(const Bytes16& v, const int16_t* s) {
  int32_t r = 0;
  for (int i = 0; i < COUNT; ++i) r += v.v[16 - COUNT + i] * s[i];
  return r;
}
// the x86 version's lane-sum ops, as one lane
inline I32 dot16_lanes(const int8_t* m, const int16_t* s) { return from_int(dot16(m, s)); }
template <int COUNT>
inline I32 dot_bytes_lanes(const Bytes16& v, const int16_t* s) { return from_int(dot_bytes<COUNT>(v, s)); }
template <int BIT, int V>
inline U8 add_bit(U8 u, U8 bits) { return or8(u, field<BIT, 1, __builtin_ctz(V)>(bits)); }
#endif

// ---------------------------------------------------------------- activation quantization
// Symmetric int8 per block of BLOCK values: d = max|x| / 127, q = round(x * (127 / max|x|)) in float (the tests
// replicate exactly this). The max is taken on the bit patterns (|x| orders as its bits do), which vectorizes
// where a float max would not without -ffast-math.
template <int BLOCK, typename T>
void quantize_row(const T* x, const Activations& act, int64_t t) {
  int8_t* q = const_cast<int8_t*>(act.qrow(t));
  float* scale = const_cast<float*>(act.scale_row(t));
  int16_t* sums16 = const_cast<int16_t*>(act.sums16_row(t));
  int16_t* sums32 = const_cast<int16_t*>(act.sums32_row(t));
  float* scaled_sums = const_cast<float*>(act.scaled_sums_row(t));
  for (int64_t b = 0; b < act.K / BLOCK; ++b) {
    float values[BLOCK];
    uint32_t max_bits = 0;
    for (int i = 0; i < BLOCK; ++i) {
      values[i] = load_activation(x, b * BLOCK + i);
      uint32_t bits;
      std::memcpy(&bits, &values[i], sizeof bits);
      bits &= 0x7fffffffu;
      max_bits = bits > max_bits ? bits : max_bits;
    }
    const float amax = bits_to_float(max_bits);
    const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    int8_t* qb = q + b * BLOCK;
    for (int i = 0; i < BLOCK; ++i) qb[i] = static_cast<int8_t>(nearest_int(values[i] * inverse));
    int32_t block_sum = 0;
    for (int g = 0; g < BLOCK / 16; ++g) {
      int32_t sum = 0;
      for (int i = 0; i < 16; ++i) sum += qb[g * 16 + i];
      sums16[b * (BLOCK / 16) + g] = static_cast<int16_t>(sum);
      block_sum += sum;
    }
    for (int g = 0; g < BLOCK / 32; ++g)
      sums32[b * (BLOCK / 32) + g] =
          static_cast<int16_t>(sums16[b * (BLOCK / 16) + 2 * g] + sums16[b * (BLOCK / 16) + 2 * g + 1]);
    scale[b] = amax / 127.0f;
    scaled_sums[b] = scale[b] * static_cast<float>(block_sum);
    if (act.bias128 != nullptr) const_cast<int32_t*>(act.bias128_row(t))[b] = -128 * block_sum;
  }
  if (act.q_pairs != nullptr) {
    int8_t* pairs = const_cast<int8_t*>(act.q_pairs_row(t));
    const int64_t nb = act.K / 32;
    for (int64_t b = 0; b + 2 <= nb; b += 2)
      for (int half = 0; half < 2; ++half)
        for (int blk = 0; blk < 2; ++blk)
          std::memcpy(pairs + b * 32 + half * 32 + blk * 16, q + (b + blk) * 32 + half * 16, 16);
    if (nb % 2) std::memcpy(pairs + (nb - 1) * 32, q + (nb - 1) * 32, 32);
  }
}

void quantize_rows(int dtype, const void* x, int64_t ldx, int64_t t_begin, int64_t t_end, const Activations& act) {
  for (int64_t t = t_begin; t < t_end; ++t) {
    if (dtype == 0) {
      const float* row = static_cast<const float*>(x) + t * ldx;
      act.block == 32 ? quantize_row<32>(row, act, t) : quantize_row<256>(row, act, t);
    } else {
      const uint16_t* row = static_cast<const uint16_t*>(x) + t * ldx;
      act.block == 32 ? quantize_row<32>(row, act, t) : quantize_row<256>(row, act, t);
    }
  }
}

// The 12 packed bytes of a Q4_K / Q5_K block's scales and mins as 8 scales then 8 mins (unpack_scales_mins_k4, in a
// register).
inline Bytes16 packed_scales_mins_k4(const uint8_t* packed) {
  constexpr uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
  uint32_t u[3];
  std::memcpy(u, packed, 12);
  return bytes16(u[0] & kmask1, (u[2] & kmask2) | (((u[0] >> 6) & kmask3) << 4), u[1] & kmask1,
                 ((u[2] >> 4) & kmask2) | (((u[1] >> 6) & kmask3) << 4));
}

// A Q3_K block's 16 signed scales (unpack_scales_q3_k, in a register).
inline Bytes16 packed_scales_q3_k(const uint8_t* packed) {
  constexpr uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f;
  uint32_t u[3];
  std::memcpy(u, packed, 12);
  return minus(bytes16((u[0] & kmask2) | ((u[2] & kmask1) << 4), (u[1] & kmask2) | (((u[2] >> 2) & kmask1) << 4),
                       ((u[0] >> 4) & kmask2) | (((u[2] >> 4) & kmask1) << 4),
                       ((u[1] >> 4) & kmask2) | (((u[2] >> 6) & kmask1) << 4)),
               32);
}

// ---------------------------------------------------------------- one weight row against NT activation rows
// Each kernel writes out[t] = <row, activation row t0 + t> for t < NT. `nb` is the number of blocks in the row.

// Software prefetch: the bytes kPrefetchAhead past a block of BYTES bytes, every cache line of it. Where the loads
// are dense (the repacked kernels, the Q6_K and Q4_K / Q5_K row kernels) the hardware prefetcher alone does not run
// far enough ahead: a batch-1 Q8_0 / Q5_0 GEMV stayed at ~70% of the read bound; 8 KiB ahead measured 1.1-1.35x
// faster at 1 token and 1.05-1.6x at 4-16 (AVX-512 and AVX2, scripts/bench_gguf_ab.py; Q5_K 1.02-1.1x), 1 and 4 KiB
// less, 16 KiB no better. A prefetch past the weights' end cannot fault. The other row kernels have none: 512 bytes
// ahead measured no better there (scripts/bench_gguf_kernels.py); they are compute-bound (Q2_K, Q3_K) or rarely run.
constexpr int64_t kPrefetchAhead = 8192;
template <int BYTES>
inline void prefetch_ahead(const uint8_t* blk) {
  for (int offset = 0; offset < BYTES; offset += 64) __builtin_prefetch(blk + kPrefetchAhead + offset);
}

// Runs body(b, lane) for every block b < nb, lane = b % kLanes(NT): one float accumulator set per lane, so that
// consecutive blocks do not wait on each other's FMA (4 cycles of latency against about 2 of work per block).
template <int NT>
constexpr int kLanes = NT == 1 ? 4 : NT == 2 ? 2 : 1;

// Runs body(b, lane) for every block b < nb, lane = b % L (the last nb % L blocks on lane 0).
template <int L, typename Body>
inline void for_lanes(int64_t nb, Body&& body) {
  int64_t b = 0;
  for (; b + L <= nb; b += L)
    for (int lane = 0; lane < L; ++lane) body(b + lane, lane);
  for (; b < nb; ++b) body(b, 0);
}

template <int NT, typename Body>
inline void for_blocks(int64_t nb, Body&& body) {
  constexpr int L = kLanes<NT>;
  int64_t b = 0;
  for (; b + L <= nb; b += L)
    for (int lane = 0; lane < L; ++lane) body(b + lane, lane);
  for (; b < nb; ++b) body(b, 0);
}

template <int NT>
inline float reduce_lanes(const F32 (&acc)[kLanes<NT>][NT], int t) {
  F32 total = acc[0][t];
  for (int lane = 1; lane < kLanes<NT>; ++lane) total = total + acc[lane][t];
  return hsum(total);
}

template <int NT>
inline float reduce_offsets(const float (&offset)[kLanes<NT>][NT], int t) {
  float total = offset[0][t];
  for (int lane = 1; lane < kLanes<NT>; ++lane) total += offset[lane][t];
  return total;
}

template <int NT>
void row_q4_0(const uint8_t* row, int64_t nb, const Activations& a, int64_t t0, float* out) {
  F32 acc[kLanes<NT>][NT];
  float offset[kLanes<NT>][NT] = {};
  for (auto& lane : acc)
    for (auto& v : lane) v = fzero();
  for_blocks<NT>(nb, [&](int64_t b, int lane) {
    const uint8_t* blk = row + b * 18;
    const float d = half_to_float(blk);
    const U8 u = nibbles16(blk + 2);  // q in [0, 16): the weight is d * (q - 8)
    for (int t = 0; t < NT; ++t) {
      const int8_t* x = a.qrow(t0 + t) + b * 32;
      acc[lane][t] = fma_i32(acc[lane][t], dot(izero(), u, x), d * a.scale_row(t0 + t)[b]);
      offset[lane][t] += d * a.scaled_sums_row(t0 + t)[b];
    }
  });
  for (int t = 0; t < NT; ++t) out[t] = reduce_lanes<NT>(acc, t) - 8.0f * reduce_offsets<NT>(offset, t);
}

template <int NT>
void row_q4_1(const uint8_t* row, int64_t nb, const Activations& a, int64_t t0, float* out) {
  F32 acc[kLanes<NT>][NT];
  float offset[kLanes<NT>][NT] = {};
  for (auto& lane : acc)
    for (auto& v : lane) v = fzero();
  for_blocks<NT>(nb, [&](int64_t b, int lane) {
    const uint8_t* blk = row + b * 20;
    const float d = half_to_float(blk), m = half_to_float(blk + 2);
    const U8 u = nibbles16(blk + 4);  // the weight is d * q + m
    for (int t = 0; t < NT; ++t) {
      const int8_t* x = a.qrow(t0 + t) + b * 32;
      acc[lane][t] = fma_i32(acc[lane][t], dot(izero(), u, x), d * a.scale_row(t0 + t)[b]);
      offset[lane][t] += m * a.scaled_sums_row(t0 + t)[b];
    }
  });
  for (int t = 0; t < NT; ++t) out[t] = reduce_lanes<NT>(acc, t) + reduce_offsets<NT>(offset, t);
}

template <int NT>
void row_q8_0(const uint8_t* row, int64_t nb, const Activations& a, int64_t t0, float* out) {
  F32 acc[kLanes<NT>][NT];
  for (auto& lane : acc)
    for (auto& v : lane) v = fzero();
  for_blocks<NT>(nb, [&](int64_t b, int lane) {
    const uint8_t* blk = row + b * 34;
    const float d = half_to_float(blk);
    const U8 w = load32(blk + 2);
    for (int t = 0; t < NT; ++t) {
      const int8_t* x = a.qrow(t0 + t) + b * 32;
      acc[lane][t] = fma_i32(acc[lane][t], dot_signed(izero(), w, x), d * a.scale_row(t0 + t)[b]);
    }
  });
  for (int t = 0; t < NT; ++t) out[t] = reduce_lanes<NT>(acc, t);
}

#if TM_ISA_X86
// The 32-wide types on x86 for 2-4 activation rows, eight blocks at a time: one gather fetches the eight fp16 scales
// (and Q4_1's mins), one conversion and one multiply per row make the weight-scale x activation-scale products, and
// each block takes its product with one in-register permute. 1.5x faster per row than a block at a time at 4 rows;
// slower at 1 row (measured), where row_q4_pairs (Q4_0, Q4_1) and row_q8_0 run instead.
// KIND: 0 Q4_0 (d * (q - 8)), 1 Q4_1 (d * q + m), 2 Q8_0 (d * q, q signed).
template <int KIND>
inline U8 weights_32wide(const uint8_t* blk) {
  if constexpr (KIND == 0) return nibbles16(blk + 2);
  else if constexpr (KIND == 1) return nibbles16(blk + 4);
  else return load32(blk + 2);
}

template <int KIND>
inline I32 dot_32wide(U8 w, const int8_t* x) {
  if constexpr (KIND == 2) return dot_signed(izero(), w, x);
  else return dot(izero(), w, x);
}

// The low (HIGH = false) or high halves of eight 32-bit lanes as floats (they hold fp16 numbers).
template <bool HIGH>
inline __m256 halves_to_float(__m256i lanes) {
  const __m256i pick = HIGH ? _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1, 2, 3, 6, 7,
                                               10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1)
                            : _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4, 5,
                                               8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(lanes, pick), 0x08);
  return _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
}

// Q4_0 / Q4_1 for one activation row on x86, two blocks per 256-bit vector: one 32-byte vector holds both blocks'
// nibbles, so the unpacking is an AND and a shift per two blocks, and the two blocks' scales are converted and
// multiplied together. Reads the activations in the pair-interleaved order (Activations::q_pairs).
template <int KIND>
void row_q4_pairs(const uint8_t* row, int64_t nb, const Activations& a, int64_t t, float* out) {
  constexpr int kBytes = KIND == 0 ? 18 : 20, kQs = KIND == 0 ? 2 : 4;
  const int8_t* xp = a.q_pairs_row(t);
  const float* dx = a.scale_row(t);
  const float* dxs = a.scaled_sums_row(t);
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  __m128 offset = _mm_setzero_ps();
  int64_t b = 0;
  for (int lane = 0; b + 2 <= nb; b += 2, lane ^= 1) {
    const uint8_t* blk = row + b * kBytes;
    const __m256i v = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kQs))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kBytes + kQs)), 1);
    const U8 lo = _mm256_and_si256(v, low_nibbles), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibbles);
    const I32 sums = dot(dot(izero(), lo, xp + b * 32), hi, xp + b * 32 + 32);  // lanes 0-3: block b; 4-7: b + 1
    __m128i halves = _mm_insert_epi16(_mm_cvtsi32_si128(load_u16(blk)), load_u16(blk + kBytes), 1);
    if constexpr (KIND == 1) {
      halves = _mm_insert_epi16(halves, load_u16(blk + 2), 2);
      halves = _mm_insert_epi16(halves, load_u16(blk + kBytes + 2), 3);
    }
    const __m128 dm = _mm_cvtph_ps(halves);  // d_b, d_b+1 (, m_b, m_b+1)
    const __m128 scales = _mm_mul_ps(dm, _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(dx + b))));
    acc[lane] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums),
                                _mm256_permutevar8x32_ps(_mm256_castps128_ps256(scales), spread), acc[lane]);
    const __m128 factor = KIND == 0 ? dm : _mm_movehl_ps(dm, dm);
    offset = _mm_fmadd_ps(factor, _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(dxs + b))), offset);
  }
  float total = hsum(_mm256_add_ps(acc[0], acc[1]));
  float offsets = _mm_cvtss_f32(_mm_add_ss(offset, _mm_movehdup_ps(offset)));
  if (b < nb) {  // an odd last block, stored in natural order
    const uint8_t* blk = row + b * kBytes;
    const float d = half_to_float(blk);
    total += hsum(fma_i32(fzero(), dot(izero(), nibbles16(blk + kQs), xp + b * 32), d * dx[b]));
    offsets += (KIND == 0 ? d : half_to_float(blk + 2)) * dxs[b];
  }
  out[0] = total + (KIND == 0 ? -8.0f * offsets : offsets);
}

template <int NT, int KIND>
void row_32wide(const uint8_t* row, int64_t nb, const Activations& a, int64_t t0, float* out) {
  constexpr int kBytes = KIND == 0 ? 18 : KIND == 1 ? 20 : 34;
  constexpr int L = NT == 1 ? 2 : 1;
  const __m256i gather_offsets = _mm256_setr_epi32(0, kBytes, 2 * kBytes, 3 * kBytes, 4 * kBytes, 5 * kBytes,
                                                   6 * kBytes, 7 * kBytes);
  F32 acc[L][NT];
  __m256 offset[NT];
  for (int t = 0; t < NT; ++t) {
    offset[t] = _mm256_setzero_ps();
    for (int lane = 0; lane < L; ++lane) acc[lane][t] = fzero();
  }
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    const uint8_t* group = row + b * kBytes;
    const __m256i words = _mm256_i32gather_epi32(reinterpret_cast<const int*>(group), gather_offsets, 1);
    const __m256 d = halves_to_float<false>(words);
    __m256 scale[NT];
    for (int t = 0; t < NT; ++t) {
      scale[t] = _mm256_mul_ps(d, _mm256_loadu_ps(a.scale_row(t0 + t) + b));
      if constexpr (KIND != 2) {
        const __m256 factor = KIND == 0 ? d : halves_to_float<true>(words);
        offset[t] = _mm256_fmadd_ps(factor, _mm256_loadu_ps(a.scaled_sums_row(t0 + t) + b), offset[t]);
      }
    }
    for (int j = 0; j < 8; ++j) {
      const U8 w = weights_32wide<KIND>(group + j * kBytes);
      const __m256i lane_j = _mm256_set1_epi32(j);
      for (int t = 0; t < NT; ++t) {
        const I32 v = dot_32wide<KIND>(w, a.qrow(t0 + t) + (b + j) * 32);
        acc[j % L][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_permutevar8x32_ps(scale[t], lane_j),
                                        acc[j % L][t]);
      }
    }
  }
  float tail_offset[NT] = {};
  for (; b < nb; ++b) {
    const uint8_t* blk = row + b * kBytes;
    const float d = half_to_float(blk);
    const U8 w = weights_32wide<KIND>(blk);
    for (int t = 0; t < NT; ++t) {
      acc[0][t] = fma_i32(acc[0][t], dot_32wide<KIND>(w, a.qrow(t0 + t) + b * 32), d * a.scale_row(t0 + t)[b]);
      if constexpr (KIND != 2)
        tail_offset[t] += (KIND == 0 ? d : half_to_float(blk + 2)) * a.scaled_sums_row(t0 + t)[b];
    }
  }
  for (int t = 0; t < NT; ++t) {
    F32 total = acc[0][t];
    if constexpr (L == 2) total = _mm256_add_ps(total, acc[1][t]);
    const float offsets = hsum(offset[t]) + tail_offset[t];
    out[t] = hsum(total) + (KIND == 0 ? -8.0f * offsets : KIND == 1 ? offsets : 0.0f);
  }
}
#endif

// Q4_K / Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins: the weight is d * scale_j * q - dmin * min_j.
template <int NT, bool FIVE_BITS>
void row_q45_k(const uint8_t* row, int64_t nb, const Activations& a, int64_t t0, float* out) {
  constexpr int kBytes = FIVE_BITS ? 176 : 144;
  F32 acc[NT], offset[NT];  // offset: the mins' part
  for (int t = 0; t < NT; ++t) acc[t] = fzero(), offset[t] = fzero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * kBytes;
    prefetch_ahead<kBytes>(blk);
    const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
    const Bytes16 scales_mins = packed_scales_mins_k4(blk + 4);
    const ScaleVec scales = scale_vec<0>(scales_mins);
    const uint8_t* qs = blk + (FIVE_BITS ? 48 : 16);
    I32 sum[NT][2];
    for (int t = 0; t < NT; ++t) sum[t][0] = sum[t][1] = izero();
    U8 high_bits{};
    if constexpr (FIVE_BITS) high_bits = load32(blk + 16);
    // Sub-blocks 2c and 2c + 1 are the low and high nibbles of 32 bytes; Q5_K's fifth bits are bits 2c, 2c + 1 of qh.
    auto chunk = [&](auto c_constant) {
      constexpr int c = decltype(c_constant)::value;
      const U8 q = load32(qs + 32 * c);
      U8 lo = low4(q), hi = high4(q);
      if constexpr (FIVE_BITS) {
        lo = add_bit<2 * c, 16>(lo, high_bits);
        hi = add_bit<2 * c + 1, 16>(hi, high_bits);
      }
      const Scales16 s_lo = pick<2 * c, 2 * c>(scales), s_hi = pick<2 * c + 1, 2 * c + 1>(scales);
      for (int t = 0; t < NT; ++t) {
        const int8_t* x = a.qrow(t0 + t) + b * 256 + 64 * c;
        sum[t][0] = dot_scaled(sum[t][0], lo, x, s_lo);
        sum[t][1] = dot_scaled(sum[t][1], hi, x + 32, s_hi);
      }
    };
    chunk(std::integral_constant<int, 0>{});
    chunk(std::integral_constant<int, 1>{});
    chunk(std::integral_constant<int, 2>{});
    chunk(std::integral_constant<int, 3>{});
    for (int t = 0; t < NT; ++t) {
      const float dx = a.scale_row(t0 + t)[b];
      acc[t] = fma_i32(acc[t], iadd(sum[t][0], sum[t][1]), d * dx);
      offset[t] = fma_i32(offset[t], dot_bytes_lanes<8>(scales_mins, a.sums32_row(t0 + t) + b * 8), dmin * dx);
    }
  }
  for (int t = 0; t < NT; ++t) out[t] = hsum(acc[t]) - hsum(offset[t]);
}

// Q6_K: 16 groups of 16 with int8 scales; q = 4 low bits (ql) | 2 high bits (qh) << 4; the weight is
// d * scale_g * (q - 32).
template <int NT>
void row_q6_k(const uint8_t* row, int64_t nb, const Activations& a, int64_t t0, float* out) {
  F32 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = fzero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 210;
    prefetch_ahead<210>(blk);
    const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = half_to_float(blk + 208);
    I32 sum[NT][2];
    for (int t = 0; t < NT; ++t) sum[t][0] = sum[t][1] = izero();
    for (int h = 0; h < 2; ++h) {  // two halves of 128: ql[64], qh[32], 8 scales each
      const uint8_t* ql = blk + 64 * h;
      const U8 l0 = load32(ql), l1 = load32(ql + 32), qh = load32(blk + 128 + 32 * h);
      const int8_t* sc = scales + 8 * h;
      const U8 q[4] = {or8(low4(l0), field<0, 3, 4>(qh)), or8(low4(l1), field<2, 3, 4>(qh)),
                       or8(high4(l0), field<4, 3, 4>(qh)), or8(high4(l1), field<6, 3, 4>(qh))};
      const ScaleVec sv = load_scales(sc);
      const Scales16 s[4] = {pick<0, 1>(sv), pick<2, 3>(sv), pick<4, 5>(sv), pick<6, 7>(sv)};
      for (int t = 0; t < NT; ++t) {
        const int8_t* x = a.qrow(t0 + t) + b * 256 + 128 * h;
        for (int i = 0; i < 4; ++i) sum[t][i & 1] = dot_scaled(sum[t][i & 1], q[i], x + 32 * i, s[i]);
      }
    }
    for (int t = 0; t < NT; ++t) {
      // the -32 offset, 32 sum_g scale_g * sum of group g's activations, taken off in integers (exact: |sum| < 2^29)
      const I32 offset = ishl<5>(dot16_lanes(scales, a.sums16_row(t0 + t) + b * 16));
      acc[t] = fma_i32(acc[t], isub(iadd(sum[t][0], sum[t][1]), offset), d * a.scale_row(t0 + t)[b]);
    }
  }
  for (int t = 0; t < NT; ++t) out[t] = hsum(acc[t]);
}

// ---------------------------------------------------------------- Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K
// Batch-invariant like the k-quant rows above: an activation row's blocks are summed in an order that does not
// depend on NT (the 32-wide types take two accumulator chains per row for any NT), so a token's result is the same
// bits alone or among others.

// Q5_0 / Q5_1: 32 weights, 4 low bits per nibble (as Q4_0 / Q4_1) and the fifth bits in a 32-bit word; the weight is
// d * (q - 16) (Q5_0) or d * q + m (Q5_1). Q5_0's offset -16 d is exact, so d * q + m covers both.
template <int NT, int QT>
void row_q5(const uint8_t* row, int64_t nb, const Activations& a, int64_t t0, float* out) {
  constexpr int kBytes = block_bytes(QT), kHigh = QT == Q5_0 ? 2 : 4;
  F32 acc[2][NT];
  float offset[2][NT] = {};
  for (auto& lane : acc)
    for (auto& v : lane) v = fzero();
  for_lanes<2>(nb, [&](int64_t b, int lane) {
    const uint8_t* blk = row + b * kBytes;
    const float d = half_to_float(blk);
    const float m = QT == Q5_0 ? -16.0f * d : half_to_float(blk + 2);
    const U8 u = or8(nibbles16(blk + kHigh + 4), bit_bytes<16>(blk + kHigh));  // q in [0, 32)
    for (int t = 0; t < NT; ++t) {
      acc[lane][t] = fma_i32(acc[lane][t], dot(izero(), u, a.qrow(t0 + t) + b * 32), d * a.scale_row(t0 + t)[b]);
      offset[lane][t] += m * a.scaled_sums_row(t0 + t)[b];
    }
  });
  for (int t = 0; t < NT; ++t) out[t] = hsum(acc[0][t] + acc[1][t]) + (offset[0][t] + offset[1][t]);
}

// IQ4_NL: 32 weights d * kIq4nlValues[q], q the 4-bit quants in Q4_0's nibble order.
template <int NT>
void row_iq4_nl(const uint8_t* row, int64_t nb, const Activations& a, int64_t t0, float* out) {
  F32 acc[2][NT];
  for (auto& lane : acc)
    for (auto& v : lane) v = fzero();
  for_lanes<2>(nb, [&](int64_t b, int lane) {
    const uint8_t* blk = row + b * 18;
    const float d = half_to_float(blk);
    const U8 w = lookup16(kIq4nlValues, nibbles16(blk + 2));  // signed, in [-127, 113]
    for (int t = 0; t < NT; ++t)
      acc[lane][t] = fma_i32(acc[lane][t], dot_signed(izero(), w, a.qrow(t0 + t) + b * 32),
                             d * a.scale_row(t0 + t)[b]);
  });
  for (int t = 0; t < NT; ++t) out[t] = hsum(acc[0][t] + acc[1][t]);
}

// Q2_K: 16 groups of 16 with a 4-bit scale and a 4-bit min each; 2-bit quants, element 128 n + 32 j + l being bits
// 2j, 2j + 1 of byte 32 n + l. The weight is d * scale_g * q - dmin * min_g.
template <int NT>
void row_q2_k(const uint8_t* row, int64_t nb, const Activations& a, int64_t t0, float* out) {
  F32 acc[NT], offset[NT];  // offset: the mins' part
  for (int t = 0; t < NT; ++t) acc[t] = fzero(), offset[t] = fzero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 84;
    const float d = half_to_float(blk + 80), dmin = half_to_float(blk + 82);
    const Bytes16 packed = load_bytes16(blk), mins = nibbles_of<4>(packed), scales = nibbles_of<0>(packed);
    const ScaleVec sv[2] = {scale_vec<0>(scales), scale_vec<1>(scales)};
    I32 sum[NT][2];
    for (int t = 0; t < NT; ++t) sum[t][0] = sum[t][1] = izero();
    auto chunk = [&](int n, auto j_constant) {
      constexpr int j = decltype(j_constant)::value;
      const U8 u = field<2 * j, 3, 0>(load32(blk + 16 + 32 * n));
      const Scales16 s = pick<2 * j, 2 * j + 1>(sv[n]);
      for (int t = 0; t < NT; ++t)
        sum[t][j & 1] = dot_scaled(sum[t][j & 1], u, a.qrow(t0 + t) + b * 256 + 128 * n + 32 * j, s);
    };
    for (int n = 0; n < 2; ++n) {
      chunk(n, std::integral_constant<int, 0>{});
      chunk(n, std::integral_constant<int, 1>{});
      chunk(n, std::integral_constant<int, 2>{});
      chunk(n, std::integral_constant<int, 3>{});
    }
    for (int t = 0; t < NT; ++t) {
      const float dx = a.scale_row(t0 + t)[b];
      acc[t] = fma_i32(acc[t], iadd(sum[t][0], sum[t][1]), d * dx);
      offset[t] = fma_i32(offset[t], dot_bytes_lanes<16>(mins, a.sums16_row(t0 + t) + b * 16), dmin * dx);
    }
  }
  for (int t = 0; t < NT; ++t) out[t] = hsum(acc[t]) - hsum(offset[t]);
}

// Q3_K: 16 groups of 16 with signed 6-bit scales; 3-bit quants: Q2_K's two low bits, and bit 4 n + j of hmask[l]
// for element 128 n + 32 j + l. The weight is d * scale_g * (q - 4).
template <int NT>
void row_q3_k(const uint8_t* row, int64_t nb, const Activations& a, int64_t t0, float* out) {
  F32 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = fzero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 110;
    const float d = half_to_float(blk + 108);
    const Bytes16 scales = packed_scales_q3_k(blk + 96);
    const ScaleVec sv[2] = {scale_vec<0>(scales), scale_vec<1>(scales)};
    const U8 hmask = load32(blk);
    I32 sum[NT][2];
    for (int t = 0; t < NT; ++t) sum[t][0] = sum[t][1] = izero();
    auto chunk = [&](auto n_constant, auto j_constant) {
      constexpr int n = decltype(n_constant)::value, j = decltype(j_constant)::value;
      const U8 u = add_bit<4 * n + j, 4>(field<2 * j, 3, 0>(load32(blk + 32 + 32 * n)), hmask);  // [0, 8)
      const Scales16 s = pick<2 * j, 2 * j + 1>(sv[n]);
      for (int t = 0; t < NT; ++t)
        sum[t][j & 1] = dot_scaled(sum[t][j & 1], u, a.qrow(t0 + t) + b * 256 + 128 * n + 32 * j, s);
    };
    auto half = [&](auto n_constant) {
      chunk(n_constant, std::integral_constant<int, 0>{});
      chunk(n_constant, std::integral_constant<int, 1>{});
      chunk(n_constant, std::integral_constant<int, 2>{});
      chunk(n_constant, std::integral_constant<int, 3>{});
    };
    half(std::integral_constant<int, 0>{});
    half(std::integral_constant<int, 1>{});
    for (int t = 0; t < NT; ++t) {
      // the -4 offset, 4 sum_g scale_g * sum of group g's activations, taken off in integers (exact)
      const I32 offset = ishl<2>(dot_bytes_lanes<16>(scales, a.sums16_row(t0 + t) + b * 16));
      acc[t] = fma_i32(acc[t], isub(iadd(sum[t][0], sum[t][1]), offset), d * a.scale_row(t0 + t)[b]);
    }
  }
  for (int t = 0; t < NT; ++t) out[t] = hsum(acc[t]);
}

// ---------------------------------------------------------------- a tile of output rows

template <template <int> class Row>
void tile_rows(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t row_begin, int64_t row_end,
               const Activations& a, int64_t T, float* y) {
  float out[4];
  for (int64_t t0 = 0; t0 < T; t0 += 4) {
    const int64_t nt = std::min<int64_t>(4, T - t0);
    for (int64_t n = row_begin; n < row_end; ++n) {
      const uint8_t* row = w + n * row_bytes;
      switch (nt) {
        case 4: Row<4>::run(row, nb, a, t0, out); break;
        case 3: Row<3>::run(row, nb, a, t0, out); break;
        case 2: Row<2>::run(row, nb, a, t0, out); break;
        default: Row<1>::run(row, nb, a, t0, out); break;
      }
      for (int64_t t = 0; t < nt; ++t) y[(t0 + t) * a.ldy + n] = out[t];
    }
  }
}

#if TM_ISA_X86
template <int NT> struct RowQ4_0 {
  static void run(const uint8_t* r, int64_t nb, const Activations& a, int64_t t0, float* o) {
    if constexpr (NT == 1) row_q4_pairs<0>(r, nb, a, t0, o); else row_32wide<NT, 0>(r, nb, a, t0, o);
  }
};
template <int NT> struct RowQ4_1 {
  static void run(const uint8_t* r, int64_t nb, const Activations& a, int64_t t0, float* o) {
    if constexpr (NT == 1) row_q4_pairs<1>(r, nb, a, t0, o); else row_32wide<NT, 1>(r, nb, a, t0, o);
  }
};
template <int NT> struct RowQ8_0 {
  static void run(const uint8_t* r, int64_t nb, const Activations& a, int64_t t0, float* o) {
    if constexpr (NT == 1) row_q8_0<1>(r, nb, a, t0, o); else row_32wide<NT, 2>(r, nb, a, t0, o);
  }
};
#else
template <int NT> struct RowQ4_0 {
  static void run(const uint8_t* r, int64_t nb, const Activations& a, int64_t t0, float* o) {
    row_q4_0<NT>(r, nb, a, t0, o);
  }
};
template <int NT> struct RowQ4_1 {
  static void run(const uint8_t* r, int64_t nb, const Activations& a, int64_t t0, float* o) {
    row_q4_1<NT>(r, nb, a, t0, o);
  }
};
template <int NT> struct RowQ8_0 {
  static void run(const uint8_t* r, int64_t nb, const Activations& a, int64_t t0, float* o) {
    row_q8_0<NT>(r, nb, a, t0, o);
  }
};
#endif
template <int NT> struct RowQ4_K {
  static void run(const uint8_t* r, int64_t nb, const Activations& a, int64_t t0, float* o) {
    row_q45_k<NT, false>(r, nb, a, t0, o);
  }
};
template <int NT> struct RowQ5_K {
  static void run(const uint8_t* r, int64_t nb, const Activations& a, int64_t t0, float* o) {
    row_q45_k<NT, true>(r, nb, a, t0, o);
  }
};
template <int NT> struct RowQ6_K {
  static void run(const uint8_t* r, int64_t nb, const Activations& a, int64_t t0, float* o) {
    row_q6_k<NT>(r, nb, a, t0, o);
  }
};
template <int NT> struct RowQ5_0 {
  static void run(const uint8_t* r, int64_t nb, const Activations& a, int64_t t0, float* o) {
    row_q5<NT, Q5_0>(r, nb, a, t0, o);
  }
};
template <int NT> struct RowQ5_1 {
  static void run(const uint8_t* r, int64_t nb, const Activations& a, int64_t t0, float* o) {
    row_q5<NT, Q5_1>(r, nb, a, t0, o);
  }
};
template <int NT> struct RowIQ4_NL {
  static void run(const uint8_t* r, int64_t nb, const Activations& a, int64_t t0, float* o) {
    row_iq4_nl<NT>(r, nb, a, t0, o);
  }
};
template <int NT> struct RowQ2_K {
  static void run(const uint8_t* r, int64_t nb, const Activations& a, int64_t t0, float* o) {
    row_q2_k<NT>(r, nb, a, t0, o);
  }
};
template <int NT> struct RowQ3_K {
  static void run(const uint8_t* r, int64_t nb, const Activations& a, int64_t t0, float* o) {
    row_q3_k<NT>(r, nb, a, t0, o);
  }
};

#if TM_ISA_X86
// ---------------------------------------------------------------- Q6_K at many activation rows
// Prefill chunks and batch-16 steps: each group of 8 weight rows is unpacked once per tile (Q6K8Block), then every
// activation row takes 8 rows' 4-element dot products per vpdpbusd (AVX2: per maddubs, two of them summed in int16,
// at most 2 * 2 * 63 * 127 < 32768, then scaled by one vpmaddwd with the sub-block's scales), as the repacked kernels
// do; row_q6_k unpacks a block again for every 4 activation rows (1.65x slower at 256 rows of Qwen2.5-0.5B's down
// projection on AVX-512; AVX2 1.65-1.84x). The same integer sums per 16-element sub-block and per
// block (exact), then one float FMA per block in block order: a row's result does not depend on the batch, but the
// float summation differs from row_q6_k's (8 lanes per row, summed at the end), so decode rows and prompt rows are
// not the same bits on Q6_K, as before (the plain kernels never were across 1-3 and 4 rows).
// From this many activation rows on (AVX-512: 9 measured slower than row_q6_k, the unpacking not yet paid back, 16
// faster; AVX2 on a Zen 3 core: 16 0.76-0.93x, 32 1.10-1.23x, 64 1.52-1.55x, 256 1.65-1.84x, bench_gguf_ab.py)
#if TM_VNNI
constexpr int64_t kQ6kManyRows = 16;
#else
constexpr int64_t kQ6kManyRows = 32;
#endif
inline int32_t dword_at(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
struct Q6K8Block {
  uint8_t q[64][32];       // 4-element group v (elements 4v..4v+3) of the 8 rows, 4 bytes a row: the 6-bit quants
#if TM_VNNI
  int32_t scale[16][8];    // sub-block g's scale, per row
#else
  int16_t scale[16][16];   // sub-block g's scale, twice per row (the two int16 pair sums of a row's 4 products)
#endif
  int16_t offset[8][8][2];  // sub-blocks 2p, 2p + 1's scales times -32, per row: with the activations' 16-sums
  float d[8];
};

// Rows r < 8 of `rows` (row_bytes apart), one 256-value block each, into `out`.
void unpack_q6_k_group(const uint8_t* rows, int64_t row_bytes, int64_t b, Q6K8Block& out) {
  for (int r = 0; r < 8; ++r) {
    const uint8_t* blk = rows + r * row_bytes + b * 210;
    const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
    for (int h = 0; h < 2; ++h) {  // as row_q6_k: elements 128 h + 32 i + l of ql, qh
      const U8 l0 = load32(blk + 64 * h), l1 = load32(blk + 64 * h + 32), qh = load32(blk + 128 + 32 * h);
      const U8 q[4] = {or8(low4(l0), field<0, 3, 4>(qh)), or8(low4(l1), field<2, 3, 4>(qh)),
                       or8(high4(l0), field<4, 3, 4>(qh)), or8(high4(l1), field<6, 3, 4>(qh))};
      for (int i = 0; i < 4; ++i) {
        alignas(32) uint8_t bytes[32];
        _mm256_store_si256(reinterpret_cast<__m256i*>(bytes), q[i]);
        for (int k = 0; k < 8; ++k) std::memcpy(&out.q[32 * h + 8 * i + k][4 * r], bytes + 4 * k, 4);
      }
    }
#if TM_VNNI
    for (int g = 0; g < 16; ++g) out.scale[g][r] = scales[g];
#else
    for (int g = 0; g < 16; ++g) out.scale[g][2 * r] = out.scale[g][2 * r + 1] = scales[g];
#endif
    for (int p = 0; p < 8; ++p)
      for (int i = 0; i < 2; ++i) out.offset[p][r][i] = static_cast<int16_t>(-32 * scales[2 * p + i]);
    out.d[r] = half_to_float(blk + 208);
  }
}

// y[t * ldy + r] = <row r of the unpacked group, activation row t0 + t> for r < 8, t < NT.
template <int NT>
void q6_k_rows8(const Q6K8Block* blocks, int64_t nb, const Activations& a, int64_t t0, float* y) {
  __m256 acc[NT];
  for (auto& v : acc) v = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const Q6K8Block& u = blocks[b];
    __m256i sum[NT];
    for (int t = 0; t < NT; ++t) {  // the -32 offset: -32 sum_g scale_g * (sum of sub-block g's activations)
      const int16_t* sums = a.sums16_row(t0 + t) + b * 16;
      sum[t] = _mm256_setzero_si256();
      for (int p = 0; p < 8; ++p) {
        const __m256i offsets = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u.offset[p]));
        const __m256i pair_sums = _mm256_set1_epi32(dword_at(sums + 2 * p));
#if TM_VNNI
        sum[t] = _mm256_dpwssd_epi32(sum[t], offsets, pair_sums);
#else
        sum[t] = _mm256_add_epi32(sum[t], _mm256_madd_epi16(offsets, pair_sums));
#endif
      }
    }
    for (int g = 0; g < 16; ++g) {
      const __m256i scale = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u.scale[g]));
      auto x4 = [&](int t, int v) { return _mm256_set1_epi32(dword_at(a.qrow(t0 + t) + b * 256 + 16 * g + 4 * v)); };
#if TM_VNNI
      __m256i part[NT];
      for (auto& v : part) v = _mm256_setzero_si256();
      for (int v = 0; v < 4; ++v) {
        const __m256i w = load32(u.q[4 * g + v]);
        for (int t = 0; t < NT; ++t) part[t] = _mm256_dpbusd_epi32(part[t], w, x4(t, v));
      }
      for (int t = 0; t < NT; ++t) sum[t] = _mm256_add_epi32(sum[t], _mm256_mullo_epi32(part[t], scale));
#else
      for (int half = 0; half < 2; ++half) {  // groups 2 half, 2 half + 1: their int16 pair sums added, then scaled
        const __m256i w0 = load32(u.q[4 * g + 2 * half]), w1 = load32(u.q[4 * g + 2 * half + 1]);
        for (int t = 0; t < NT; ++t) {
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(w0, x4(t, 2 * half)),
                                                 _mm256_maddubs_epi16(w1, x4(t, 2 * half + 1)));
          sum[t] = _mm256_add_epi32(sum[t], _mm256_madd_epi16(pairs, scale));
        }
      }
#endif
    }
    const __m256 d = _mm256_loadu_ps(u.d);
    for (int t = 0; t < NT; ++t)
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t]), _mm256_mul_ps(d, _mm256_set1_ps(a.scale_row(t0 + t)[b])), acc[t]);
  }
  for (int t = 0; t < NT; ++t) _mm256_storeu_ps(y + t * a.ldy, acc[t]);
}

// Rows [row_begin, row_end) for all T activation rows: whole groups of 8 unpacked, the rest by row_q6_k.
void q6_k_tile_many(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t row_begin, int64_t row_end,
                    const Activations& a, int64_t T, float* y) {
  const int64_t groups = (row_end - row_begin) / 8;
  thread_local std::vector<Q6K8Block> unpacked;  // per thread: a 16-row tile of K = 4864 is 106 KiB
  unpacked.resize(static_cast<size_t>(groups * nb));
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t b = 0; b < nb; ++b) unpack_q6_k_group(w + (row_begin + 8 * g) * row_bytes, row_bytes, b, unpacked[g * nb + b]);
  for (int64_t t0 = 0; t0 < T; t0 += 8) {
    const int64_t nt = std::min<int64_t>(8, T - t0);
    for (int64_t g = 0; g < groups; ++g) {
      const Q6K8Block* blocks = unpacked.data() + g * nb;
      float* out = y + t0 * a.ldy + row_begin + 8 * g;
      switch (nt) {
        case 8: q6_k_rows8<8>(blocks, nb, a, t0, out); break;
        case 7: q6_k_rows8<7>(blocks, nb, a, t0, out); break;
        case 6: q6_k_rows8<6>(blocks, nb, a, t0, out); break;
        case 5: q6_k_rows8<5>(blocks, nb, a, t0, out); break;
        case 4: q6_k_rows8<4>(blocks, nb, a, t0, out); break;
        case 3: q6_k_rows8<3>(blocks, nb, a, t0, out); break;
        case 2: q6_k_rows8<2>(blocks, nb, a, t0, out); break;
        default: q6_k_rows8<1>(blocks, nb, a, t0, out); break;
      }
    }
  }
  if (row_begin + 8 * groups < row_end) tile_rows<RowQ6_K>(w, row_bytes, nb, row_begin + 8 * groups, row_end, a, T, y);
}
#endif

void run_tile(int qtype, const uint8_t* w, int64_t row_bytes, int64_t row_begin, int64_t row_end,
              const Activations& a, int64_t T, float* y) {
  const int64_t nb = a.K / block_elems(qtype);
  switch (qtype) {
    case Q4_0: tile_rows<RowQ4_0>(w, row_bytes, nb, row_begin, row_end, a, T, y); break;
    case Q4_1: tile_rows<RowQ4_1>(w, row_bytes, nb, row_begin, row_end, a, T, y); break;
    case Q8_0: tile_rows<RowQ8_0>(w, row_bytes, nb, row_begin, row_end, a, T, y); break;
    case Q4_K: tile_rows<RowQ4_K>(w, row_bytes, nb, row_begin, row_end, a, T, y); break;
    case Q5_K: tile_rows<RowQ5_K>(w, row_bytes, nb, row_begin, row_end, a, T, y); break;
    case Q6_K:
#if TM_ISA_X86
      if (T >= kQ6kManyRows) return q6_k_tile_many(w, row_bytes, nb, row_begin, row_end, a, T, y);
#endif
      tile_rows<RowQ6_K>(w, row_bytes, nb, row_begin, row_end, a, T, y);
      break;
    case Q5_0: tile_rows<RowQ5_0>(w, row_bytes, nb, row_begin, row_end, a, T, y); break;
    case Q5_1: tile_rows<RowQ5_1>(w, row_bytes, nb, row_begin, row_end, a, T, y); break;
    case IQ4_NL: tile_rows<RowIQ4_NL>(w, row_bytes, nb, row_begin, row_end, a, T, y); break;
    case Q2_K: tile_rows<RowQ2_K>(w, row_bytes, nb, row_begin, row_end, a, T, y); break;
    case Q3_K: tile_rows<RowQ3_K>(w, row_bytes, nb, row_begin, row_end, a, T, y); break;
    default: break;
  }
}

// ---------------------------------------------------------------- the repacked layout: 8 rows interleaved
// tm_gguf_matmul_repacked's weights. A group of 8 output rows is 8 * row_bytes bytes, its blocks b = 0, 1, ... one
// after the other, block b of the group (8 * block_bytes bytes) holding:
//   the 8 rows' fp16 scales d (16 bytes), for Q4_1 / Q5_1 then their 8 fp16 mins m (16 bytes);
//   the rest of the block in 4-byte groups: group j of row 0, of row 1, ..., of row 7 (32 bytes), for j = 0, 1, ...:
//   Q4_0, Q4_1 and IQ4_NL the 16 plain quant bytes (j < 4: byte 4j + i holds element 4j + i in its low and
//   16 + 4j + i in its high nibble); Q5_0 and Q5_1 the 32-bit word of fifth bits (j = 0; transposed: bit j of byte i
//   for element 4j + i, bit 4 + j for 16 + 4j + i, see `transposed_fifth_bits`) then
//   those 16 bytes (j = 1..4); Q8_0 the 32 signed bytes (j < 8). The bytes are those of the plain blocks, moved.
// KIND: 0 Q4_0 (d * (q - 8)), 1 Q4_1 (d * q + m), 2 Q8_0 (d * q, q signed), 3 Q5_0 (d * (q - 16)), 4 Q5_1 (d * q + m),
// 5 IQ4_NL (d * kIq4nlValues[q]).

template <int KIND>
constexpr int kKindType = KIND == 0 ? Q4_0 : KIND == 1 ? Q4_1 : KIND == 2 ? Q8_0 : KIND == 3 ? Q5_0 : KIND == 4 ? Q5_1
                                                                                                               : IQ4_NL;
template <int KIND>
constexpr int kGroupBytes = 8 * block_bytes(kKindType<KIND>);
template <int KIND>
constexpr int kGroupScales = 8 * packed_scale_bytes(kKindType<KIND>);  // bytes before the 4-byte groups
template <int KIND>
constexpr bool kFiveBits = KIND == 3 || KIND == 4;
// the weight's offset per unit of d (Q4_0 -8, Q5_0 -16), for the kinds without a stored min
template <int KIND>
constexpr float kOffsetPerD = KIND == 0 ? -8.0f : KIND == 3 ? -16.0f : 0.0f;
template <int KIND>
constexpr bool kHasOffset = KIND == 0 || KIND == 1 || KIND == 3 || KIND == 4;

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

#if TM_ISA_X86
#if TM_VNNI
constexpr int kPackedTokens = 8;  // activation rows per pass over a group's blocks (registers: 32 vectors)
#else
constexpr int kPackedTokens = 4;  // 16 vectors
#endif

// The two weight vectors of 4-byte group j < 4 of a nibble kind's packed block (8 rows): lanes r hold row r's
// elements 4j..4j+3 (lo) and 16+4j..16+4j+3 (hi) as bytes. Q5_0 / Q5_1 add their fifth bits (16); IQ4_NL looks its
// values up: signed on AVX2, plus 128 on VNNI (whose vpdpbusd takes unsigned weights; the activations' bias128
// takes the 128 off).
template <int KIND>
inline void packed_weights(const uint8_t* blk, int j, __m256i& lo, __m256i& hi) {
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  const uint8_t* qs = blk + kGroupScales<KIND> + (kFiveBits<KIND> ? 32 : 0);
  const __m256i v = load32(qs + 32 * j);
  lo = _mm256_and_si256(v, low_nibbles);
  hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibbles);
  if constexpr (kFiveBits<KIND>) {
    // the 8 rows' transposed words of fifth bits (`transposed_fifth_bits`) line up with the quants' bytes: bit j of
    // each byte to bit 4 for lo (the 16-bit shift's carry from the byte below lands under bit 4), bit 4 + j for hi
    const __m256i qh = load32(blk + kGroupScales<KIND>);
    const __m256i sixteen = _mm256_set1_epi8(16);
    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(qh, 4 - j), sixteen));
    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srli_epi16(qh, j), sixteen));
  }
  if constexpr (KIND == 5) {
    __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kIq4nlValues)));
#if TM_VNNI
    table = _mm256_xor_si256(table, _mm256_set1_epi8(static_cast<char>(0x80)));
#endif
    lo = _mm256_shuffle_epi8(table, lo);
    hi = _mm256_shuffle_epi8(table, hi);
  }
}

// y[t * ldy + r] = <row r of the group, activation row t0 + t> for r < 8, t < NT.
// Batch-invariant: an activation row's result does not depend on NT or on the other rows (one accumulator per
// activation row, blocks added in order: two chains at NT = 1 measured no faster), so a token verified among
// speculative ones gets the same logits bit for bit as decoded alone, given the same activations.
template <int NT, int KIND>
void packed_rows(const uint8_t* group, int64_t nb, const Activations& a, int64_t t0, float* y) {
  [[maybe_unused]] constexpr bool kSigned = KIND == 2 || KIND == 5;  // Q8_0, IQ4_NL: signed weights (VNNI bias)
  __m256 acc[NT];
  for (auto& v : acc) v = _mm256_setzero_ps();
  // the activation rows' data, from pointers set once (the *_row accessors divide by the block size)
  const int8_t* xrow[NT];
  const float *dx[NT], *dxs[NT];
  [[maybe_unused]] const int32_t* bias[NT];  // the signed kinds on VNNI only
  for (int t = 0; t < NT; ++t) {
    xrow[t] = a.q + (t0 + t) * a.K;
    dx[t] = a.scale + (t0 + t) * nb;
    dxs[t] = a.scaled_sums + (t0 + t) * nb;
    bias[t] = a.bias128 + (t0 + t) * nb;
  }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * kGroupBytes<KIND>;
    prefetch_ahead<kGroupBytes<KIND>>(blk);
    const uint8_t* qs = blk + kGroupScales<KIND>;
    const int8_t* x[NT];
    for (int t = 0; t < NT; ++t) x[t] = xrow[t] + b * 32;
    I32 sum[NT];  // lane r: row r's integer dot product with activation row t0 + t over block b
#if TM_VNNI
    // S independent vpdpbusd chains per activation row where there are few rows: a block's 8 would otherwise wait
    // on each other's latency
    constexpr int S = NT == 1 ? 4 : NT == 2 ? 2 : 1;
    I32 part[S][NT];
    for (int t = 0; t < NT; ++t) {
      // signed weights: vpdpbusd takes unsigned ones, w + 128 (Q8_0: the sign bit flipped; IQ4_NL: a biased table),
      // and the 128 * sum(x) that adds is taken off from the start
      part[0][t] = kSigned ? _mm256_set1_epi32(bias[t][b]) : izero();
      for (int i = 1; i < S; ++i) part[i][t] = izero();
    }
    if constexpr (KIND == 2) {
      const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
      for (int j = 0; j < 8; ++j) {
        const __m256i w = _mm256_xor_si256(load32(qs + 32 * j), flip);
        for (int t = 0; t < NT; ++t)
          part[j % S][t] = _mm256_dpbusd_epi32(part[j % S][t], w, _mm256_set1_epi32(load_i32(x[t] + 4 * j)));
      }
    } else {
      for (int j = 0; j < 4; ++j) {
        __m256i lo, hi;
        packed_weights<KIND>(blk, j, lo, hi);
        for (int t = 0; t < NT; ++t) {
          I32& even = part[(2 * j) % S][t];
          I32& odd = part[(2 * j + 1) % S][t];
          even = _mm256_dpbusd_epi32(even, lo, _mm256_set1_epi32(load_i32(x[t] + 4 * j)));
          odd = _mm256_dpbusd_epi32(odd, hi, _mm256_set1_epi32(load_i32(x[t] + 16 + 4 * j)));
        }
      }
    }
    for (int t = 0; t < NT; ++t) {
      sum[t] = part[0][t];
      for (int i = 1; i < S; ++i) sum[t] = _mm256_add_epi32(sum[t], part[i][t]);
    }
#else
    const __m256i ones = _mm256_set1_epi16(1);
    // acc + the signed bytes w times the broadcast activation bytes xv (the sign moves onto x, as dot_signed)
    auto signed_dot = [&](__m256i acc32, __m256i w, __m256i xv) {
      return _mm256_add_epi32(acc32, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w),
                                                                           _mm256_sign_epi8(xv, w)), ones));
    };
    for (int t = 0; t < NT; ++t) sum[t] = izero();
    if constexpr (KIND == 2) {
      for (int j = 0; j < 8; ++j) {
        const __m256i w = load32(qs + 32 * j);
        for (int t = 0; t < NT; ++t) sum[t] = signed_dot(sum[t], w, _mm256_set1_epi32(load_i32(x[t] + 4 * j)));
      }
    } else if constexpr (KIND == 5) {
      for (int j = 0; j < 4; ++j) {
        __m256i lo, hi;
        packed_weights<KIND>(blk, j, lo, hi);
        for (int t = 0; t < NT; ++t) {
          sum[t] = signed_dot(sum[t], lo, _mm256_set1_epi32(load_i32(x[t] + 4 * j)));
          sum[t] = signed_dot(sum[t], hi, _mm256_set1_epi32(load_i32(x[t] + 16 + 4 * j)));
        }
      }
    } else {
      // int16 pair sums, widened every kWiden groups before they can overflow: 4 bits 4 groups * 2 * 2 * 15 * 127,
      // 5 bits 2 groups * 2 * 2 * 31 * 127, both < 32768
      constexpr int kWiden = kFiveBits<KIND> ? 2 : 4;
      __m256i pairs[NT];
      for (int t = 0; t < NT; ++t) pairs[t] = izero();
      for (int j = 0; j < 4; ++j) {
        __m256i lo, hi;
        packed_weights<KIND>(blk, j, lo, hi);
        for (int t = 0; t < NT; ++t) {
          pairs[t] = _mm256_add_epi16(
              pairs[t], _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(x[t] + 4 * j))),
                                         _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(x[t] + 16 + 4 * j)))));
          if (j % kWiden == kWiden - 1) {
            sum[t] = _mm256_add_epi32(sum[t], _mm256_madd_epi16(pairs[t], ones));
            pairs[t] = izero();
          }
        }
      }
    }
#endif
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    for (int t = 0; t < NT; ++t)
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t]), _mm256_mul_ps(d, _mm256_set1_ps(dx[t][b])), acc[t]);
    if constexpr (kHasOffset<KIND>) {  // the offset: -8 d (Q4_0), -16 d (Q5_0) or m, times the block's activation sum
      const __m256 m = kOffsetPerD<KIND> != 0.0f
                           ? _mm256_mul_ps(d, _mm256_set1_ps(kOffsetPerD<KIND>))
                           : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
      for (int t = 0; t < NT; ++t)
        acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(dxs[t][b]), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) _mm256_storeu_ps(y + t * a.ldy, acc[t]);
}

#if TM_VNNI
// Two activation rows per 512-bit vector, for the 4-bit kinds at 4-8 rows. packed_rows<NT> issues a 256-bit
// vpdpbusd and a vpbroadcastd of the row's 4 activation bytes per row and 4-byte group (32 of each a block at 4 rows,
// ~105 instructions in all: their issue bound it, at ~60% of the 1-row GEMV's bytes per second). Here a block's 8 weight rows are unpacked once into
// both 256-bit halves, a pair of activation rows sits in one vector (row a's 32 bytes of the block low, row b's
// high), each group's bytes are spread to both halves' lanes by one vpermd, and one 512-bit vpdpbusd does both rows.
// The float steps are packed_rows' on each half in its order, so each row's result is packed_rows<1>'s to the bit
// (batch-invariant). The rows' per-block scales are laid out as pair vectors once per thread and call.
// (std::vector drops a vector type's alignment from its template argument: these structs keep it)
struct alignas(64) Int512 {
  __m512i v;
};
struct alignas(64) Float512 {
  __m512 v;
};
struct PairActivations {
  uint64_t call = 0;  // whose activations these are (Activations::call), and which rows
  int64_t first_row = -1, rows = 0, blocks = 0;
  const int8_t* x[8];  // each row's int8 activations (an odd last row is also its own pair's second)
  std::vector<Float512> scale, scaled_sum;  // [pair][block]: dx and the block's scaled sum, each half its row's
  std::vector<Int512> bias;  // [pair][block]: IQ4_NL's bias128
};

inline __m512 float_halves(float low, float high) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(low)), _mm256_set1_ps(high), 1);
}
inline __m512i int_halves(__m256i low, __m256i high) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
}
inline __m512i both_halves(__m256i v) { return int_halves(v, v); }
inline __m512 both_halves(__m256 v) { return _mm512_insertf32x8(_mm512_castps256_ps512(v), v, 1); }

// Rows t0 .. t0 + rows - 1 of `a` as pairs (an odd last row paired with itself; its copy's results are not stored);
// the bias vectors only for a kind that reads them (`with_bias`: IQ4_NL).
inline void pair_activations(const Activations& a, int64_t t0, int64_t rows, int64_t nb, bool with_bias,
                             PairActivations& p) {
  if (p.call == a.call && p.first_row == t0 && p.rows == rows) return;  // laid out by this thread for this call
  p.call = a.call;
  p.first_row = t0;
  p.rows = rows;
  const int64_t pairs = (rows + 1) / 2;
  p.blocks = nb;
  p.scale.resize(pairs * nb);
  p.scaled_sum.resize(pairs * nb);
  with_bias = with_bias && a.bias128 != nullptr;
  p.bias.resize(with_bias ? pairs * nb : 0);
  for (int64_t q = 0; q < pairs; ++q) {
    const int64_t ta = t0 + 2 * q, tb = std::min(ta + 1, t0 + rows - 1);
    p.x[2 * q] = a.q + ta * a.K;
    p.x[2 * q + 1] = a.q + tb * a.K;
    for (int64_t b = 0; b < nb; ++b) {
      p.scale[q * nb + b].v = float_halves(a.scale[ta * nb + b], a.scale[tb * nb + b]);
      p.scaled_sum[q * nb + b].v = float_halves(a.scaled_sums[ta * nb + b], a.scaled_sums[tb * nb + b]);
      if (!with_bias) continue;
      p.bias[q * nb + b].v =
          int_halves(_mm256_set1_epi32(a.bias128[ta * nb + b]), _mm256_set1_epi32(a.bias128[tb * nb + b]));
    }
  }
}

// The kinds packed_row_pairs serves: the 4-bit ones, where it measured 1.05-1.3x packed_rows' speed at 4-8 rows
// (Q8_0, Q5_0 and Q5_1 within noise of it, or slower: their weight vectors cost more to widen than they save).
template <int KIND>
constexpr bool kPairedKind = KIND == 0 || KIND == 1 || KIND == 5;

// y[t * ldy + r] = <row r of the group, activation row t0 + t> for r < 8 and the `rows` (<= 2 * NP) rows of pairs
// 0 .. NP - 1 of `p`, as packed_rows<rows, KIND>.
template <int NP, int KIND>
void packed_row_pairs(const uint8_t* group, const PairActivations& p, int64_t rows, float* y, int64_t ldy) {
  static_assert(kPairedKind<KIND>, "a 4-bit kind");
  constexpr bool kSigned = KIND == 5;  // IQ4_NL: signed values (the VNNI bias, as packed_rows; pair_activations')
  const int64_t nb = p.blocks;
  const __m512i kHalves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8);  // vpermd's half
  __m512 acc[NP];
  for (auto& v : acc) v = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * kGroupBytes<KIND>;
    prefetch_ahead<kGroupBytes<KIND>>(blk);
    const uint8_t* qs = blk + kGroupScales<KIND>;
    __m512i sum[NP];  // each pair's integer dot products over the block (one chain: 2-4 pairs interleave)
    for (int q = 0; q < NP; ++q) sum[q] = kSigned ? p.bias[q * nb + b].v : _mm512_setzero_si512();
    __m512i rows_x[NP];  // [row a's 32 bytes of block b | row b's]
    for (int q = 0; q < NP; ++q) {
      const auto* row_a = reinterpret_cast<const uint8_t*>(p.x[2 * q] + b * 32);
      const auto* row_b = reinterpret_cast<const uint8_t*>(p.x[2 * q + 1] + b * 32);
      rows_x[q] = int_halves(load32(row_a), load32(row_b));
    }
    // a pair's 4-byte group g of the block: row a's in every low lane, row b's in every high one
    auto group_of = [&](int q, int g) {
      return _mm512_permutexvar_epi32(_mm512_add_epi32(_mm512_set1_epi32(g), kHalves), rows_x[q]);
    };
    for (int j = 0; j < 4; ++j) {
      __m512i lo, hi;  // the 8 weight rows' elements 4j.. and 16 + 4j.. in both halves
      if constexpr (KIND != 5) {
        const __m512i v = _mm512_broadcast_i64x4(load32(qs + 32 * j));
        const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
        lo = _mm512_and_si512(v, low_nibbles);
        hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low_nibbles);
      } else {
        __m256i lo8, hi8;
        packed_weights<KIND>(blk, j, lo8, hi8);
        lo = both_halves(lo8);
        hi = both_halves(hi8);
      }
      for (int q = 0; q < NP; ++q) {
        sum[q] = _mm512_dpbusd_epi32(sum[q], lo, group_of(q, j));
        sum[q] = _mm512_dpbusd_epi32(sum[q], hi, group_of(q, 4 + j));
      }
    }
    const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    const __m512 d = both_halves(d8);
    for (int q = 0; q < NP; ++q)
      acc[q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[q]), _mm512_mul_ps(d, p.scale[q * nb + b].v), acc[q]);
    if constexpr (kHasOffset<KIND>) {
      const __m256 m8 = kOffsetPerD<KIND> != 0.0f
                            ? _mm256_mul_ps(d8, _mm256_set1_ps(kOffsetPerD<KIND>))
                            : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
      const __m512 m = both_halves(m8);
      for (int q = 0; q < NP; ++q) acc[q] = _mm512_fmadd_ps(m, p.scaled_sum[q * nb + b].v, acc[q]);
    }
  }
  for (int q = 0; q < NP; ++q) {
    _mm256_storeu_ps(y + 2 * q * ldy, _mm512_castps512_ps256(acc[q]));
    if (2 * q + 1 < rows) _mm256_storeu_ps(y + (2 * q + 1) * ldy, _mm512_extractf32x8_ps(acc[q], 1));
  }
}

// packed_tile_rows' groups for the `rows` (4-8) activation rows from t0, in pairs (packed_row_pairs).
template <int KIND>
void packed_pairs_tile(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t group_begin, int64_t group_end,
                       const Activations& a, int64_t t0, int64_t rows, float* y) {
  thread_local PairActivations pairs;
  pair_activations(a, t0, rows, nb, KIND == 5, pairs);
  for (int64_t g = group_begin; g < group_end; ++g) {
    const uint8_t* group = w + g * 8 * row_bytes;
    float* out = y + t0 * a.ldy + g * 8;
    switch ((rows + 1) / 2) {
      case 4: packed_row_pairs<4, KIND>(group, pairs, rows, out, a.ldy); break;
      case 3: packed_row_pairs<3, KIND>(group, pairs, rows, out, a.ldy); break;
      default: packed_row_pairs<2, KIND>(group, pairs, rows, out, a.ldy); break;
    }
  }
}
#endif

#if !TM_VNNI
// The nibble kinds without a lookup (Q4_0, Q4_1, Q5_0, Q5_1) on AVX2 at 2 or more activation rows (a speculative-
// decoding verification step, a prefill): packed_rows<NT, KIND>'s integer products and float steps for up to 8 rows
// at once. A block's 4-byte groups are unpacked once for all NT rows (packed_rows: again for every 4), and each
// group's two weight vectors go to every row before the next group, so the rows' products are independent work side
// by side (the order of the Q4_1 kernel this one replaced, a block's weights held in registers and one row's whole
// block at a time, measured 1.12x slower at 256 rows). The rows' int16 pair sums stay in registers; their int32 sums
// and float accumulators go to the stack.
// The same bits as packed_rows: the int16 pair sums are exact in any order (4 bits: 8 maddubs of 2 * 15 * 127 each stay
// below 32768; 5 bits: widened every 4, 4 * 2 * 31 * 127 < 32768), and each row's float accumulator takes the same two
// FMAs per block, in block order.
// (At 256 rows on a Zen 3 core, against packed_rows: Q4_0 1.24x, Q4_1 1.12x (against the kernel this one replaced,
// which held a block's weights in registers), Q5_0 1.18x, Q5_1 1.18x; the Q5 figures with their transposed fifth
// bits, bench_gguf_ab.py.)
template <int KIND>
constexpr bool kNibbleTileKind = KIND == 0 || KIND == 1 || KIND == 3 || KIND == 4;

template <int NT, int KIND>
void packed_nibble_rows(const uint8_t* group, int64_t nb, const Activations& a, int64_t t0, float* y) {
  static_assert(kNibbleTileKind<KIND>, "a nibble kind without a lookup");
  const int64_t K = a.K;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[NT];
  __m256i sum[NT];
  for (auto& v : acc) v = _mm256_setzero_ps();
  const int8_t* xrow = a.q + t0 * K;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * kGroupBytes<KIND>;
    prefetch_ahead<kGroupBytes<KIND>>(blk);
    const int8_t* x = xrow + 32 * b;  // activation row t0 + t's block b: x + t * K
    __m256i pairs[NT];
    for (int j = 0; j < 4; ++j) {
      __m256i lo, hi;
      packed_weights<KIND>(blk, j, lo, hi);
      for (int t = 0; t < NT; ++t) {
        // (the address written out: a pointer per row held in a local measured 0.84-0.93x at 256 rows on Q4_0 / Q4_1)
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(x + t * K + 4 * j))),
                                           _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(x + t * K + 16 + 4 * j))));
        pairs[t] = j == 0 || (kFiveBits<KIND> && j == 2) ? p : _mm256_add_epi16(pairs[t], p);
      }
      if (kFiveBits<KIND> && j == 1)
        for (int t = 0; t < NT; ++t) sum[t] = _mm256_madd_epi16(pairs[t], ones);
    }
    for (int t = 0; t < NT; ++t) {
      const __m256i last = _mm256_madd_epi16(pairs[t], ones);
      sum[t] = kFiveBits<KIND> ? _mm256_add_epi32(sum[t], last) : last;
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    const __m256 m = kOffsetPerD<KIND> != 0.0f
                         ? _mm256_mul_ps(d, _mm256_set1_ps(kOffsetPerD<KIND>))
                         : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
    const float* dx = a.scale + t0 * nb + b;       // row t0 + t's scale: dx[t * nb]
    const float* dxs = a.scaled_sums + t0 * nb + b;  // its scale times its int8 sum: dxs[t * nb]
    for (int t = 0; t < NT; ++t) {
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t]), _mm256_mul_ps(d, _mm256_set1_ps(dx[t * nb])), acc[t]);
      acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(dxs[t * nb]), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) _mm256_storeu_ps(y + t * a.ldy, acc[t]);
}

// Groups [group_begin, group_end) of a nibble kind for T >= 2 activation rows, 8 rows per pass.
template <int KIND>
void packed_nibble_tile(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t group_begin, int64_t group_end,
                        const Activations& a, int64_t T, float* y) {
  for (int64_t t0 = 0; t0 < T; t0 += 8) {
    const int64_t nt = std::min<int64_t>(8, T - t0);
    for (int64_t g = group_begin; g < group_end; ++g) {
      const uint8_t* group = w + g * 8 * row_bytes;
      float* out = y + t0 * a.ldy + g * 8;
      switch (nt) {
        case 8: packed_nibble_rows<8, KIND>(group, nb, a, t0, out); break;
        case 7: packed_nibble_rows<7, KIND>(group, nb, a, t0, out); break;
        case 6: packed_nibble_rows<6, KIND>(group, nb, a, t0, out); break;
        case 5: packed_nibble_rows<5, KIND>(group, nb, a, t0, out); break;
        case 4: packed_nibble_rows<4, KIND>(group, nb, a, t0, out); break;
        case 3: packed_nibble_rows<3, KIND>(group, nb, a, t0, out); break;
        case 2: packed_nibble_rows<2, KIND>(group, nb, a, t0, out); break;
        default: packed_nibble_rows<1, KIND>(group, nb, a, t0, out); break;
      }
    }
  }
}
#endif

template <int KIND>
void packed_tile_rows(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t group_begin, int64_t group_end,
                      const Activations& a, int64_t T, float* y) {
#if !TM_VNNI
  if constexpr (kNibbleTileKind<KIND>) {
    // (Q4_0's unpacking is the cheapest: below 8 rows packed_rows measured as fast, 0.93-1.03x at 2 and 0.96-1.00x
    // at 4)
    if (T >= (KIND == 0 ? 8 : 2)) return packed_nibble_tile<KIND>(w, row_bytes, nb, group_begin, group_end, a, T, y);
  }
#endif
  for (int64_t t0 = 0; t0 < T; t0 += kPackedTokens) {
    const int64_t nt = std::min<int64_t>(kPackedTokens, T - t0);
#if TM_VNNI
    if constexpr (kPairedKind<KIND>) {
      if (nt >= 4) {
        packed_pairs_tile<KIND>(w, row_bytes, nb, group_begin, group_end, a, t0, nt, y);
        continue;
      }
    }
#endif
    for (int64_t g = group_begin; g < group_end; ++g) {
      const uint8_t* group = w + g * 8 * row_bytes;
      float* out = y + t0 * a.ldy + g * 8;
      switch (nt) {
#if TM_VNNI
        case 8: packed_rows<8, KIND>(group, nb, a, t0, out); break;
        case 7: packed_rows<7, KIND>(group, nb, a, t0, out); break;
        case 6: packed_rows<6, KIND>(group, nb, a, t0, out); break;
        case 5: packed_rows<5, KIND>(group, nb, a, t0, out); break;
#endif
        case 4: packed_rows<4, KIND>(group, nb, a, t0, out); break;
        case 3: packed_rows<3, KIND>(group, nb, a, t0, out); break;
        case 2: packed_rows<2, KIND>(group, nb, a, t0, out); break;
        default: packed_rows<1, KIND>(group, nb, a, t0, out); break;
      }
    }
  }
}

#else  // the portable version (scalar, NEON): the same integer products, 8 rows at a time in plain loops

template <int KIND>
void packed_tile_rows(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t group_begin, int64_t group_end,
                      const Activations& a, int64_t T, float* y) {
  for (int64_t g = group_begin; g < group_end; ++g) {
    const uint8_t* group = w + g * 8 * row_bytes;
    for (int64_t t = 0; t < T; ++t) {
      float acc[8] = {}, offset[8] = {};
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = group + b * kGroupBytes<KIND>;
        const uint8_t* qs = blk + kGroupScales<KIND>;
        const int8_t* x = a.qrow(t) + b * 32;
        const uint8_t* quants = qs + (kFiveBits<KIND> ? 32 : 0);  // Q5_0 / Q5_1: past the words of fifth bits
        int32_t sum[8] = {};
        for (int j = 0; j < (KIND == 2 ? 8 : 4); ++j)
          for (int r = 0; r < 8; ++r)
            for (int i = 0; i < 4; ++i) {
              const uint8_t q = quants[32 * j + 4 * r + i];
              if constexpr (KIND == 2) {
                sum[r] += static_cast<int8_t>(q) * x[4 * j + i];
                continue;
              }
              int lo = q & 15, hi = q >> 4;
              if constexpr (kFiveBits<KIND>) {  // the row's transposed word (`transposed_fifth_bits`)
                const uint8_t high_bits = qs[4 * r + i];
                lo |= ((high_bits >> j) & 1) << 4;
                hi |= ((high_bits >> (4 + j)) & 1) << 4;
              }
              if constexpr (KIND == 5) lo = kIq4nlValues[lo], hi = kIq4nlValues[hi];
              sum[r] += lo * x[4 * j + i] + hi * x[16 + 4 * j + i];
            }
        for (int r = 0; r < 8; ++r) {
          const float d = half_to_float(blk + 2 * r);
          acc[r] += static_cast<float>(sum[r]) * (d * a.scale_row(t)[b]);
          if constexpr (kOffsetPerD<KIND> != 0.0f) offset[r] += d * a.scaled_sums_row(t)[b];
          if constexpr (KIND == 1 || KIND == 4) offset[r] += half_to_float(blk + 16 + 2 * r) * a.scaled_sums_row(t)[b];
        }
      }
      for (int r = 0; r < 8; ++r)
        y[t * a.ldy + g * 8 + r] = acc[r] + (kOffsetPerD<KIND> != 0.0f ? kOffsetPerD<KIND> * offset[r] : offset[r]);
    }
  }
}
#endif

// ---------------------------------------------------------------- Q4_K repacked: 8 rows interleaved
// A group's block b (8 * 144 bytes, moved as the 32-wide types' by `move_row`): the 8 rows' fp16 d (16 bytes), their
// fp16 dmin (16 bytes), then their 12 bytes of 6-bit scales and mins in 2-byte pieces (piece p: bytes 2p, 2p + 1 of
// row 0, of row 1, ..., 16 bytes a piece), then the 128 quant bytes in 4-byte groups (group j of row 0, ..., of
// row 7: 32 bytes). Group j holds elements 64c + 4i .. 64c + 4i + 3 (low nibbles) and 64c + 32 + 4i .. (high
// nibbles) for j = 8c + i, so one vpdpbusd (AVX2: maddubs) of a group's 32 bytes with a broadcast 4-byte group of
// activations adds 8 rows' partial dot products, and a sub-block's scale is applied once per 32 values and 8 rows
// (one vpmulld; AVX2 sums 8 maddubs in int16 first, at most 8 * 2 * 15 * 127 < 32768, then one vpmaddwd).
constexpr int kQ4kGroupBytes = 8 * 144;

// Row r's byte i (< 12) of its packed scales and mins in a packed block.
inline uint8_t q4k_scale_byte(const uint8_t* blk, int r, int i) { return blk[32 + 16 * (i / 2) + 2 * r + i % 2]; }

#if TM_ISA_X86
// The 8 rows' 8 sub-block scales and mins of one packed block as 16-bit lanes (lane r: row r), decoded as
// unpack_scales_mins_k4 does: byte i < 4 of a row's 12 is scale i's low 6 bits (then min i's at 4 + i); bytes 8..11
// hold the low 4 bits of scales 4..7 and (high nibbles) mins 4..7, whose top 2 bits are those of bytes 0..7.
struct Q4kScales {
  __m128i scale[8], min[8];
};
inline Q4kScales q4k_scales(const uint8_t* blk) {
  const __m128i low8 = _mm_set1_epi16(0xFF), low6 = _mm_set1_epi16(63), low4 = _mm_set1_epi16(15);
  __m128i bytes[12];
  for (int p = 0; p < 6; ++p) {
    const __m128i piece = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 + 16 * p));
    bytes[2 * p] = _mm_and_si128(piece, low8);
    bytes[2 * p + 1] = _mm_srli_epi16(piece, 8);
  }
  Q4kScales s;
  for (int i = 0; i < 4; ++i) {
    s.scale[i] = _mm_and_si128(bytes[i], low6);
    s.min[i] = _mm_and_si128(bytes[4 + i], low6);
    s.scale[4 + i] = _mm_or_si128(_mm_and_si128(bytes[8 + i], low4), _mm_slli_epi16(_mm_srli_epi16(bytes[i], 6), 4));
    s.min[4 + i] = _mm_or_si128(_mm_srli_epi16(bytes[8 + i], 4), _mm_slli_epi16(_mm_srli_epi16(bytes[4 + i], 6), 4));
  }
  return s;
}

// activation rows per pass over a group's blocks (AVX2 too: 4 against 2 measured 1.26x faster at 16 rows, though
// its 16 registers do not hold them all)
constexpr int kQ4kTokens = 4;
#if TM_VNNI
using Q4kPart = __m256i;       // int32 per row: a sub-block's integer dot products, unscaled
inline Q4kPart q4k_part(Q4kPart p, __m256i w, __m256i x) { return _mm256_dpbusd_epi32(p, w, x); }
inline __m256i q4k_scale_lanes(__m128i s) { return _mm256_cvtepu16_epi32(s); }
inline __m256i q4k_scaled(Q4kPart p, __m256i s) { return _mm256_mullo_epi32(p, s); }
#else
using Q4kPart = __m256i;       // int16 pairs per row, summed over a sub-block's 8 groups (no overflow: see above)
inline Q4kPart q4k_part(Q4kPart p, __m256i w, __m256i x) { return _mm256_add_epi16(p, _mm256_maddubs_epi16(w, x)); }
inline __m256i q4k_scale_lanes(__m128i s) {  // (scale, scale) as int16 in row r's 32-bit lane
  const __m256i v = _mm256_cvtepu16_epi32(s);
  return _mm256_or_si256(v, _mm256_slli_epi32(v, 16));
}
inline __m256i q4k_scaled(Q4kPart p, __m256i s) { return _mm256_madd_epi16(p, s); }
#endif

// y[t * ldy + r] = <row r of the group, activation row t0 + t> for r < 8, t < NT; batch-invariant (each activation
// row's operations are the same whatever NT: one float accumulator per row, blocks in order).
template <int NT>
void packed_q4_k_rows(const uint8_t* group, int64_t nb, const Activations& a, int64_t t0, float* y) {
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  __m256 acc[NT];
  for (auto& v : acc) v = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * kQ4kGroupBytes;
    prefetch_ahead<kQ4kGroupBytes>(blk);
    const Q4kScales s = q4k_scales(blk);
    __m256i sum[NT];
    for (auto& v : sum) v = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      Q4kPart lo[NT], hi[NT];
      for (int t = 0; t < NT; ++t) lo[t] = hi[t] = _mm256_setzero_si256();
      for (int i = 0; i < 8; ++i) {
        const __m256i v = load32(blk + 128 + 32 * (8 * c + i));
        const __m256i wl = _mm256_and_si256(v, low_nibbles), wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibbles);
        for (int t = 0; t < NT; ++t) {
          const int8_t* x = a.qrow(t0 + t) + b * 256 + 64 * c + 4 * i;
          lo[t] = q4k_part(lo[t], wl, _mm256_set1_epi32(load_i32(x)));
          hi[t] = q4k_part(hi[t], wh, _mm256_set1_epi32(load_i32(x + 32)));
        }
      }
      const __m256i s_lo = q4k_scale_lanes(s.scale[2 * c]), s_hi = q4k_scale_lanes(s.scale[2 * c + 1]);
      for (int t = 0; t < NT; ++t)
        sum[t] = _mm256_add_epi32(sum[t], _mm256_add_epi32(q4k_scaled(lo[t], s_lo), q4k_scaled(hi[t], s_hi)));
    }
    // the mins: row r's sum_j min_j * (sum of sub-block j's activations), two sub-blocks per vpmaddwd
    __m256i min_pairs[4];
    for (int j = 0; j < 4; ++j)
      min_pairs[j] = _mm256_setr_m128i(_mm_unpacklo_epi16(s.min[2 * j], s.min[2 * j + 1]),
                                       _mm_unpackhi_epi16(s.min[2 * j], s.min[2 * j + 1]));
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
    for (int t = 0; t < NT; ++t) {
      const int16_t* sums = a.sums32_row(t0 + t) + b * 8;
      __m256i mins = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j)
        mins = _mm256_add_epi32(mins, _mm256_madd_epi16(min_pairs[j], _mm256_set1_epi32(load_i32(reinterpret_cast<const int8_t*>(sums + 2 * j)))));
      const __m256 dx = _mm256_set1_ps(a.scale_row(t0 + t)[b]);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t]), _mm256_mul_ps(d, dx), acc[t]);
      acc[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(dmin, dx), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) _mm256_storeu_ps(y + t * a.ldy, acc[t]);
}

#else  // the portable version: the same integer sums, a row and an activation row at a time

void packed_q4_k_tile(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t group_begin, int64_t group_end,
                      const Activations& a, int64_t T, float* y) {
  for (int64_t g = group_begin; g < group_end; ++g)
    for (int r = 0; r < 8; ++r)
      for (int64_t t = 0; t < T; ++t) {
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* blk = w + g * 8 * row_bytes + b * kQ4kGroupBytes;
          uint8_t packed[12], scales_mins[16];
          for (int i = 0; i < 12; ++i) packed[i] = q4k_scale_byte(blk, r, i);
          unpack_scales_mins_k4(packed, scales_mins);
          const int8_t* x = a.qrow(t) + b * 256;
          int32_t sum = 0, mins = 0;
          for (int l = 0; l < 128; ++l) {
            const uint8_t q = blk[128 + 32 * (l / 4) + 4 * r + l % 4];
            const int c = l / 32, e = 64 * c + l % 32;  // element of the low nibble; the high one is e + 32
            sum += scales_mins[2 * c] * (q & 15) * x[e] + scales_mins[2 * c + 1] * (q >> 4) * x[e + 32];
          }
          for (int j = 0; j < 8; ++j) mins += scales_mins[8 + j] * a.sums32_row(t)[b * 8 + j];
          const float dx = a.scale_row(t)[b];
          acc += static_cast<float>(sum) * (half_to_float(blk + 2 * r) * dx);
          acc -= static_cast<float>(mins) * (half_to_float(blk + 16 + 2 * r) * dx);
        }
        y[t * a.ldy + g * 8 + r] = acc;
      }
}
#endif

// ---------------------------------------------------------------- Q2_K and Q3_K repacked: 8 rows interleaved
// The layouts are packed_segments'. Q2_K's block b of a group (8 * 84 bytes): the 8 rows' fp16 d (16 bytes) and dmin
// (16 bytes); their scale bytes (low nibble the scale, high the min), 8 bytes a sub-block g: byte 32 + 8 g + r is row
// r's; then 16 quant groups of 32 bytes, group j = 8 n + i holding each row's bytes 32 n + 4 i .. + 3, whose bit
// pair f (bits 2 f, 2 f + 1) is element 128 n + 32 f + 4 i + k, k < 4 -- so one maddubs / vpdpbusd of a group's
// bit pair f with 4 broadcast activations adds 8 rows' partial dot products over sub-block 8 n + 2 f + i / 4.
// Q3_K's (8 * 110 bytes): the 8 d (16 bytes); the 12 bytes of 6-bit scales, byte i of row r at 16 + 8 i + r; from
// 112 the 3-bit values (q3_k_values_stored) in 8 chunks of 96 bytes, chunk i the 8 rows' A, B and C bytes 4 i .. + 3
// (row r's at 4 r of each 32), which hold elements 128 n + 32 f + 4 i + k.
// The integer sums per sub-block and block are exact, as the plain kernels'; then per block and activation row one
// FMA (and Q2_K one for the mins): a row's result does not depend on NT (batch-invariant).
constexpr int kQ2kGroupBytes = 8 * 84, kQ3kGroupBytes = 8 * 110;

#if TM_ISA_X86
// Sub-block scales as q4k_scaled takes them (VNNI: int32 lanes; AVX2: (s, s) int16 pairs), row r in 32-bit lane r,
// from the 8 bytes p[0..7] (row r's at p[r]) by one broadcast and one byte shuffle: each row's byte goes to the top
// byte of its lane's 16- or 32-bit halves, and an arithmetic shift brings it down, sign-extended (SIGNED) or not
// (MASK: the bits kept of an unsigned byte, Q2_K's low-nibble scales).
template <bool SIGNED, int MASK = 0xFF>
inline __m256i k_scale_lanes_of(__m256i v) {  // the 8 bytes in each 64-bit lane of v
  constexpr char z = -128;  // a shuffle index that writes 0
#if TM_VNNI
  const __m256i lanes = _mm256_shuffle_epi8(v, _mm256_setr_epi8(z, z, z, 0, z, z, z, 1, z, z, z, 2, z, z, z, 3,
                                                                 z, z, z, 4, z, z, z, 5, z, z, z, 6, z, z, z, 7));
  const __m256i out = SIGNED ? _mm256_srai_epi32(lanes, 24) : _mm256_srli_epi32(lanes, 24);
#else
  const __m256i lanes = _mm256_shuffle_epi8(v, _mm256_setr_epi8(z, 0, z, 0, z, 1, z, 1, z, 2, z, 2, z, 3, z, 3,
                                                                 z, 4, z, 4, z, 5, z, 5, z, 6, z, 6, z, 7, z, 7));
  const __m256i out = SIGNED ? _mm256_srai_epi16(lanes, 8) : _mm256_srli_epi16(lanes, 8);
#endif
  return MASK == 0xFF ? out : _mm256_and_si256(out, _mm256_set1_epi16(MASK));
}
template <bool SIGNED, int MASK = 0xFF>
inline __m256i k_scale_lanes(const void* p) {
  int64_t bytes;
  std::memcpy(&bytes, p, sizeof bytes);
  return k_scale_lanes_of<SIGNED, MASK>(_mm256_set1_epi64x(bytes));
}

// The pairs k_sub_block_dot takes: sub-blocks 2 j and 2 j + 1's byte per row (16 bytes at p: the first 8 rows' of
// 2 j, then 2 j + 1's) as int16 (c_2j, c_2j+1) in row r's 32-bit lane, shifted down by SHIFT (Q2_K's mins: the high
// nibble) after a sign extension (SIGNED) or not.
template <bool SIGNED, int SHIFT>
inline __m256i k_sub_block_pairs_of(__m256i v) {  // the 16 bytes in each 128-bit lane of v
  constexpr char z = -128;
  const __m256i pairs = _mm256_shuffle_epi8(v, _mm256_setr_epi8(z, 0, z, 8, z, 1, z, 9, z, 2, z, 10, z, 3, z, 11,
                                                                z, 4, z, 12, z, 5, z, 13, z, 6, z, 14, z, 7, z, 15));
  return SIGNED ? _mm256_srai_epi16(pairs, 8 + SHIFT) : _mm256_srli_epi16(pairs, 8 + SHIFT);
}
template <bool SIGNED, int SHIFT>
inline __m256i k_sub_block_pairs(const void* p) {
  const __m128i bytes = _mm_loadu_si128(static_cast<const __m128i*>(p));
  return k_sub_block_pairs_of<SIGNED, SHIFT>(_mm256_broadcastsi128_si256(bytes));
}

// The 8 rows' partial sums of sub-blocks 8 n + 2 f and 8 n + 2 f + 1 (groups i = 0..3 and 4..7 of half n, bit pair
// f) with NT activation rows, each scaled by `scale(h)` (h = 0, 1: the two sub-blocks) into sum[t]. `weights(i)`
// gives group 8 n + i's bit pair f as bytes in [0, 8).
template <int NT, typename Weights, typename Scale>
inline void k_sub_blocks(const int8_t* x, int64_t K, Weights&& weights, Scale&& scale, __m256i* sum) {
  for (int h = 0; h < 2; ++h) {
    Q4kPart part[NT];
    for (auto& v : part) v = _mm256_setzero_si256();
    for (int i = 4 * h; i < 4 * h + 4; ++i) {
      const __m256i w = weights(i);
      for (int t = 0; t < NT; ++t) part[t] = q4k_part(part[t], w, _mm256_set1_epi32(load_i32(x + t * K + 4 * i)));
    }
    const __m256i s = scale(h);
    for (int t = 0; t < NT; ++t) sum[t] = _mm256_add_epi32(sum[t], q4k_scaled(part[t], s));
  }
}

// sum_g c_g * (activation row t's sum of sub-block g) for the 8 rows, c_g in 16-bit lanes: pairs[j] holds (c_2j,
// c_2j+1) in row r's 32-bit lane.
inline __m256i k_sub_block_dot(const __m256i pairs[8], const int16_t* sums) {
  __m256i out = _mm256_setzero_si256();
  for (int j = 0; j < 8; ++j) {
    const __m256i two_sums = _mm256_set1_epi32(load_i32(reinterpret_cast<const int8_t*>(sums + 2 * j)));
    out = _mm256_add_epi32(out, _mm256_madd_epi16(pairs[j], two_sums));
  }
  return out;
}

template <int NT>
void packed_q2_k_rows(const uint8_t* group, int64_t nb, const Activations& a, int64_t t0, float* y) {
  const __m256i three = _mm256_set1_epi8(3);
  __m256 acc[NT];
  for (auto& v : acc) v = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * kQ2kGroupBytes;
    prefetch_ahead<kQ2kGroupBytes>(blk);
    const uint8_t* sc = blk + 32;
    const uint8_t* qs = blk + 160;
    __m256i sum[NT];
    for (auto& v : sum) v = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int n = 0; n < 2; ++n)
#pragma GCC unroll 4
      for (int f = 0; f < 4; ++f) {
        const int g = 8 * n + 2 * f;
        k_sub_blocks<NT>(
            a.qrow(t0) + b * 256 + 128 * n + 32 * f, a.K,
            [&](int i) { return _mm256_and_si256(_mm256_srli_epi16(load32(qs + 32 * (8 * n + i)), 2 * f), three); },
            [&](int h) { return k_scale_lanes<false, 15>(sc + 8 * (g + h)); },
            sum);
      }
    // the mins (high nibbles), two sub-blocks per 32-bit lane
    __m256i min_pairs[8];
    for (int j = 0; j < 8; ++j) min_pairs[j] = k_sub_block_pairs<false, 4>(sc + 16 * j);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
    for (int t = 0; t < NT; ++t) {
      const __m256i mins = k_sub_block_dot(min_pairs, a.sums16_row(t0 + t) + b * 16);
      const __m256 dx = _mm256_set1_ps(a.scale_row(t0 + t)[b]);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t]), _mm256_mul_ps(d, dx), acc[t]);
      acc[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(dmin, dx), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) _mm256_storeu_ps(y + t * a.ldy, acc[t]);
}

// The 8 rows' 16 signed 6-bit scales of a packed Q3_K block (unpack_scales_q3_k on 8 rows at once) as bytes, 8 rows
// a sub-block: scale g's low 4 bits are the low (g < 8) or high nibble of byte g % 8, its high 2 bits bits 2 (g / 4)
// of byte 8 + g % 4; minus 32. The packed block holds byte i of row r at 16 + 8 i + r, so a vector of 32 bytes is
// 4 bytes' 8 rows: four sub-blocks at once.
struct Q3kScales {
  __m256i bytes[4];  // sub-blocks 4 q .. 4 q + 3 in bytes[q], 8 rows each
};
inline Q3kScales q3k_scales(const uint8_t* blk) {
  const __m256i low4 = _mm256_set1_epi8(15), low2 = _mm256_set1_epi8(3), offset = _mm256_set1_epi8(32);
  const __m256i bytes0 = load32(blk + 16), bytes4 = load32(blk + 48), high = load32(blk + 80);
  const __m256i low[4] = {bytes0, bytes4, _mm256_srli_epi16(bytes0, 4), _mm256_srli_epi16(bytes4, 4)};
  Q3kScales out;
  for (int q = 0; q < 4; ++q) {  // sub-blocks 4 q .. 4 q + 3
    const __m256i top = _mm256_and_si256(_mm256_srli_epi16(high, 2 * q), low2);
    const __m256i v = _mm256_or_si256(_mm256_and_si256(low[q], low4), _mm256_slli_epi16(top, 4));
    out.bytes[q] = _mm256_sub_epi8(v, offset);
  }
  return out;
}
// Sub-block G's 8 scales as k_scale_lanes gives them; sub-blocks G and G + 1's as k_sub_block_pairs (G even). Taken
// from the registers by a lane permute (through memory, 8-byte loads of a 32-byte store: a batch-1 GEMV measured
// ~1.1x slower from memory).
template <int G>
inline __m256i q3k_scale_lanes(const Q3kScales& s) {
  constexpr int q = G % 4;
  return k_scale_lanes_of<true>(_mm256_permute4x64_epi64(s.bytes[G / 4], q * 0x55));
}
template <int G>
inline __m256i q3k_scale_pairs(const Q3kScales& s) {
  constexpr int q = G % 4;
  constexpr int lanes = q | (q + 1) << 2 | q << 4 | (q + 1) << 6;  // 64-bit lanes q, q + 1 in each half
  return k_sub_block_pairs_of<true, 0>(_mm256_permute4x64_epi64(s.bytes[G / 4], lanes));
}

// Value v (= 4 n + f, see q3_k_values_stored) of a packed Q3_K block's chunk i (`abc`: its A, B and C vectors, 32
// bytes each, row r's 4 bytes at 4 r): the 8 rows' values of elements 128 n + 32 f + 4 i + k, bytes in [0, 8).
template <int V>
inline __m256i q3k_values(const uint8_t* abc) {
  const __m256i seven = _mm256_set1_epi8(7);
  const __m256i word = load32(abc + 32 * (V / 3));  // A: u_0, u_1, u_2; B: u_3, u_4, u_5; C: u_6, u_7
  if constexpr (V % 3 == 0) return _mm256_and_si256(word, seven);
  if constexpr (V % 3 == 1) return _mm256_and_si256(_mm256_srli_epi16(word, 3), seven);
  // u_2, u_5: the low bits are bits 6 and 7 of A / B, the third bit 6 / 7 of C
  const __m256i low = _mm256_and_si256(_mm256_srli_epi16(word, 6), _mm256_set1_epi8(3));
  const __m256i third = _mm256_and_si256(_mm256_srli_epi16(load32(abc + 64), V == 2 ? 4 : 5), _mm256_set1_epi8(4));
  return _mm256_or_si256(low, third);
}

// Sub-blocks 8 n + 2 f and 8 n + 2 f + 1 (V = 4 n + f) of a packed Q3_K block for NT activation rows into sum.
template <int NT, int V>
inline void q3k_sub_block_pair(const uint8_t* values, const int8_t* x, int64_t K, const Q3kScales& scales,
                               __m256i* sum) {
  constexpr int n = V / 4, f = V % 4, g = 8 * n + 2 * f;
  k_sub_blocks<NT>(
      x + 128 * n + 32 * f, K, [&](int i) { return q3k_values<V>(values + 96 * i); },
      [&](int h) { return h ? q3k_scale_lanes<g + 1>(scales) : q3k_scale_lanes<g>(scales); }, sum);
}
template <int NT, size_t... V>
inline void q3k_sub_blocks(const uint8_t* values, const int8_t* x, int64_t K, const Q3kScales& scales, __m256i* sum,
                           std::index_sequence<V...>) {
  (q3k_sub_block_pair<NT, static_cast<int>(V)>(values, x, K, scales, sum), ...);
}
template <size_t... J>
inline void q3k_all_scale_pairs(const Q3kScales& scales, __m256i pairs[8], std::index_sequence<J...>) {
  ((pairs[J] = q3k_scale_pairs<2 * static_cast<int>(J)>(scales)), ...);
}

template <int NT>
void packed_q3_k_rows(const uint8_t* group, int64_t nb, const Activations& a, int64_t t0, float* y) {
  __m256 acc[NT];
  for (auto& v : acc) v = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * kQ3kGroupBytes;
    prefetch_ahead<kQ3kGroupBytes>(blk);
    const Q3kScales scales = q3k_scales(blk);
    __m256i sum[NT];
    for (auto& v : sum) v = _mm256_setzero_si256();
    q3k_sub_blocks<NT>(blk + 112, a.qrow(t0) + b * 256, a.K, scales, sum, std::make_index_sequence<8>{});
    // the weights are q - 4: take 4 sum_g scale_g * (sum of sub-block g's activations) off, in integers (exact)
    __m256i scale_pairs[8];
    q3k_all_scale_pairs(scales, scale_pairs, std::make_index_sequence<8>{});
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    for (int t = 0; t < NT; ++t) {
      const __m256i offset = _mm256_slli_epi32(k_sub_block_dot(scale_pairs, a.sums16_row(t0 + t) + b * 16), 2);
      const __m256 dx = _mm256_set1_ps(a.scale_row(t0 + t)[b]);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sum[t], offset)), _mm256_mul_ps(d, dx), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) _mm256_storeu_ps(y + t * a.ldy, acc[t]);
}

// Groups [group_begin, group_end) of a repacked k-quant (Q2_K, Q3_K, Q4_K) for T activation rows, 4 per pass.
template <int QT>
void packed_k_tile(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t group_begin, int64_t group_end,
                   const Activations& a, int64_t T, float* y) {
  for (int64_t t0 = 0; t0 < T; t0 += kQ4kTokens) {
    const int64_t nt = std::min<int64_t>(kQ4kTokens, T - t0);
    for (int64_t g = group_begin; g < group_end; ++g) {
      const uint8_t* group = w + g * 8 * row_bytes;
      float* out = y + t0 * a.ldy + g * 8;
      auto rows = [&](auto nt_constant) {
        constexpr int NT = decltype(nt_constant)::value;
        if constexpr (QT == Q2_K) packed_q2_k_rows<NT>(group, nb, a, t0, out);
        else if constexpr (QT == Q3_K) packed_q3_k_rows<NT>(group, nb, a, t0, out);
        else packed_q4_k_rows<NT>(group, nb, a, t0, out);
      };
      switch (nt) {
        case 4: rows(std::integral_constant<int, 4>{}); break;
        case 3: rows(std::integral_constant<int, 3>{}); break;
        case 2: rows(std::integral_constant<int, 2>{}); break;
        default: rows(std::integral_constant<int, 1>{}); break;
      }
    }
  }
}

#else  // the portable version: each packed block put back in the plain layout, then the same integer sums

// A plain Q2_K / Q3_K block's part of a row's result with an activation row's block: its int8 values x, their sums
// per 16 and their scale dx.
template <int QT>
float block_term(const uint8_t* blk, const int8_t* x, const int16_t* sums, float dx) {
  int8_t q3_scales[16];
  if constexpr (QT == Q3_K) unpack_scales_q3_k(blk + 96, q3_scales);
  int32_t sum = 0, mins = 0;
  for (int e = 0; e < 256; ++e) {
    const int n = e / 128, f = e % 128 / 32, l = e % 32;
    int q = (blk[(QT == Q2_K ? 16 : 32) + 32 * n + l] >> (2 * f)) & 3;
    if constexpr (QT == Q3_K) q |= ((blk[l] >> (4 * n + f)) & 1) << 2;  // Q3_K: q - 4, the 4 taken off below
    sum += (QT == Q2_K ? blk[e / 16] & 15 : q3_scales[e / 16]) * q * x[e];
  }
  for (int g = 0; g < 16; ++g) mins += (QT == Q2_K ? blk[g] >> 4 : 4 * q3_scales[g]) * sums[g];
  if constexpr (QT == Q2_K) {
    const float d = half_to_float(blk + 80) * dx, dmin = half_to_float(blk + 82) * dx;
    return static_cast<float>(sum) * d - static_cast<float>(mins) * dmin;
  }
  return static_cast<float>(sum - mins) * (half_to_float(blk + 108) * dx);
}

template <int QT>
void packed_k_tile(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t group_begin, int64_t group_end,
                   const Activations& a, int64_t T, float* y) {
  if constexpr (QT == Q4_K) {
    packed_q4_k_tile(w, row_bytes, nb, group_begin, group_end, a, T, y);
  } else {
    constexpr int kBytes = QT == Q2_K ? 84 : 110;
    for (int64_t g = group_begin; g < group_end; ++g)
      for (int r = 0; r < 8; ++r)
        for (int64_t t = 0; t < T; ++t) {
          float acc = 0.0f;
          for (int64_t b = 0; b < nb; ++b) {
            uint8_t blk[kBytes];  // row r's block, back in the plain layout
            move_block<false>(QT, const_cast<uint8_t*>(w) + g * 8 * row_bytes + b * 8 * kBytes, r, blk);
            acc += block_term<QT>(blk, a.qrow(t) + b * 256, a.sums16_row(t) + b * 16, a.scale_row(t)[b]);
          }
          y[t * a.ldy + g * 8 + r] = acc;
        }
  }
}
#endif

void run_packed_tile(int qtype, const uint8_t* w, int64_t row_bytes, int64_t group_begin, int64_t group_end,
                     const Activations& a, int64_t T, float* y) {
  const int64_t nb = a.K / 32;
  switch (qtype) {
    case Q4_K: packed_k_tile<Q4_K>(w, row_bytes, a.K / 256, group_begin, group_end, a, T, y); break;
    case Q2_K: packed_k_tile<Q2_K>(w, row_bytes, a.K / 256, group_begin, group_end, a, T, y); break;
    case Q3_K: packed_k_tile<Q3_K>(w, row_bytes, a.K / 256, group_begin, group_end, a, T, y); break;
    case Q4_0: packed_tile_rows<0>(w, row_bytes, nb, group_begin, group_end, a, T, y); break;
    case Q4_1: packed_tile_rows<1>(w, row_bytes, nb, group_begin, group_end, a, T, y); break;
    case Q8_0: packed_tile_rows<2>(w, row_bytes, nb, group_begin, group_end, a, T, y); break;
    case Q5_0: packed_tile_rows<3>(w, row_bytes, nb, group_begin, group_end, a, T, y); break;
    case Q5_1: packed_tile_rows<4>(w, row_bytes, nb, group_begin, group_end, a, T, y); break;
    case IQ4_NL: packed_tile_rows<5>(w, row_bytes, nb, group_begin, group_end, a, T, y); break;
    default: break;
  }
}

// ---------------------------------------------------------------- the float-activation path
// Each weight block is dequantized exactly as gguf.quants does (every product there is exact in float32: an fp16
// scale times a small integer; Q4_1 / k-quant mins add with one rounding, as there), then multiplied with the float32
// activations by FMA into float32 accumulators: FV is this set's float vector of kW lanes.

#if TM_ISA_X86 && TM_VNNI
using FV = __m512;
constexpr int kW = 16;
inline FV fv_zero() { return _mm512_setzero_ps(); }
inline FV fv_load(const float* p) { return _mm512_loadu_ps(p); }
inline FV fv_fma(FV a, FV b, FV c) { return _mm512_fmadd_ps(a, b, c); }
inline FV fv_add(FV a, FV b) { return _mm512_add_ps(a, b); }
inline float fv_sum(FV v) { return _mm512_reduce_add_ps(v); }
#elif TM_ISA_X86
using FV = __m256;
constexpr int kW = 8;
inline FV fv_zero() { return _mm256_setzero_ps(); }
inline FV fv_load(const float* p) { return _mm256_loadu_ps(p); }
inline FV fv_fma(FV a, FV b, FV c) { return _mm256_fmadd_ps(a, b, c); }
inline FV fv_add(FV a, FV b) { return _mm256_add_ps(a, b); }
inline float fv_sum(FV v) { return hsum(v); }
#elif TM_ISA_NEON
using FV = float32x4_t;
constexpr int kW = 4;
inline FV fv_zero() { return vdupq_n_f32(0.0f); }
inline FV fv_load(const float* p) { return vld1q_f32(p); }
inline FV fv_fma(FV a, FV b, FV c) { return vfmaq_f32(c, a, b); }
inline FV fv_add(FV a, FV b) { return vaddq_f32(a, b); }
inline float fv_sum(FV v) { return vaddvq_f32(v); }
#else
using FV = float;
constexpr int kW = 1;
inline FV fv_zero() { return 0.0f; }
inline FV fv_load(const float* p) { return *p; }
inline FV fv_fma(FV a, FV b, FV c) { return std::fma(a, b, c); }
inline FV fv_add(FV a, FV b) { return a + b; }
inline float fv_sum(FV v) { return v; }
#endif

// Block `blk` of type QT as block_elems(QT) floats, element order (gguf.quants.dequantize).
template <int QT>
inline void dequantize_block(const uint8_t* blk, float* w) {
  if constexpr (QT == Q4_0 || QT == Q4_1) {
    const float d = half_to_float(blk);
    const float m = QT == Q4_0 ? -8.0f * d : half_to_float(blk + 2);
    const uint8_t* qs = blk + (QT == Q4_0 ? 2 : 4);
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>(qs[j] & 15) + m;
      w[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
    }
  } else if constexpr (QT == Q5_0 || QT == Q5_1) {
    const float d = half_to_float(blk);
    const float m = QT == Q5_0 ? -16.0f * d : half_to_float(blk + 2);  // d * q - 16 d: exact, as d * (q - 16)
    const uint8_t* qh = blk + (QT == Q5_0 ? 2 : 4);
    const uint8_t* qs = qh + 4;
    for (int j = 0; j < 16; ++j) {
      const int lo = (qs[j] & 15) | (((qh[j / 8] >> (j % 8)) & 1) << 4);
      const int hi = (qs[j] >> 4) | (((qh[2 + j / 8] >> (j % 8)) & 1) << 4);
      w[j] = d * static_cast<float>(lo) + m;
      w[j + 16] = d * static_cast<float>(hi) + m;
    }
  } else if constexpr (QT == IQ4_NL) {
    const float d = half_to_float(blk);
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>(kIq4nlValues[blk[2 + j] & 15]);
      w[j + 16] = d * static_cast<float>(kIq4nlValues[blk[2 + j] >> 4]);
    }
  } else if constexpr (QT == Q8_0) {
    const float d = half_to_float(blk);
    for (int j = 0; j < 32; ++j) w[j] = d * static_cast<float>(static_cast<int8_t>(blk[2 + j]));
  } else if constexpr (QT == Q2_K || QT == Q3_K) {
    // element 128 n + 32 j + l: bits 2j, 2j + 1 of qs[32 n + l] (Q3_K: minus 4 unless bit 4 n + j of hmask[l])
    constexpr bool three = QT == Q3_K;
    const uint8_t* qs = blk + (three ? 32 : 16);
    float dl[16], ml[16] = {};
    if constexpr (three) {
      const float d = half_to_float(blk + 108);
      int8_t scales[16];
      unpack_scales_q3_k(blk + 96, scales);
      for (int g = 0; g < 16; ++g) dl[g] = d * static_cast<float>(scales[g]);
    } else {
      const float d = half_to_float(blk + 80), dmin = half_to_float(blk + 82);
      for (int g = 0; g < 16; ++g) {
        dl[g] = d * static_cast<float>(blk[g] & 15);
        ml[g] = dmin * static_cast<float>(blk[g] >> 4);
      }
    }
    for (int n = 0; n < 2; ++n)
      for (int j = 0; j < 4; ++j)
        for (int l = 0; l < 32; ++l) {
          const int g = 8 * n + 2 * j + l / 16;
          int q = (qs[32 * n + l] >> (2 * j)) & 3;
          if constexpr (three) q -= ((blk[l] >> (4 * n + j)) & 1) ? 0 : 4;
          w[128 * n + 32 * j + l] = three ? dl[g] * static_cast<float>(q) : dl[g] * static_cast<float>(q) - ml[g];
        }
  } else if constexpr (QT == Q4_K || QT == Q5_K) {
    constexpr bool five = QT == Q5_K;
    const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
    uint8_t scales_mins[16];
    unpack_scales_mins_k4(blk + 4, scales_mins);
    const uint8_t* qh = blk + 16;
    const uint8_t* qs = blk + (five ? 48 : 16);
    for (int c = 0; c < 4; ++c) {
      const float d_lo = d * scales_mins[2 * c], m_lo = dmin * scales_mins[8 + 2 * c];
      const float d_hi = d * scales_mins[2 * c + 1], m_hi = dmin * scales_mins[8 + 2 * c + 1];
      for (int l = 0; l < 32; ++l) {
        int lo = qs[32 * c + l] & 15, hi = qs[32 * c + l] >> 4;
        if constexpr (five) {
          lo |= ((qh[l] >> (2 * c)) & 1) << 4;
          hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
        }
        w[64 * c + l] = d_lo * static_cast<float>(lo) - m_lo;
        w[64 * c + 32 + l] = d_hi * static_cast<float>(hi) - m_hi;
      }
    }
  } else {  // Q6_K
    const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = half_to_float(blk + 208);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = blk + 64 * h;
      const uint8_t* qh = blk + 128 + 32 * h;
      const int8_t* sc = scales + 8 * h;
      float* out = w + 128 * h;
      for (int g = 0; g < 2; ++g) {  // 16 values per scale: loops the compiler vectorizes
        const float s0 = d * sc[g], s1 = d * sc[g + 2], s2 = d * sc[g + 4], s3 = d * sc[g + 6];
        for (int l = 16 * g; l < 16 * g + 16; ++l) {
          out[l] = s0 * static_cast<float>(((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32);
          out[l + 32] = s1 * static_cast<float>(((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
          out[l + 64] = s2 * static_cast<float>(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
          out[l + 96] = s3 * static_cast<float>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
      }
    }
  }
}

#if TM_ISA_X86
// The 32-wide types dequantized straight into vectors (32 / kW of them): unsigned nibbles or signed bytes widened to
// int32, converted, then d * q + m (Q4_0: m = -8d, exact like d * (q - 8)) or d * q.
template <int QT>
inline void dequantize_32(const uint8_t* blk, FV* w) {
  if constexpr (QT == Q8_0) {
    const float d = half_to_float(blk);
#if TM_VNNI
    const __m512 dv = _mm512_set1_ps(d);
    for (int i = 0; i < 2; ++i) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 + 16 * i));
      w[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), dv);
    }
#else
    const __m256 dv = _mm256_set1_ps(d);
    for (int i = 0; i < 4; ++i) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * i));
      w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), dv);
    }
#endif
  } else {
    const float d = half_to_float(blk);
    const float m = QT == Q4_0 ? -8.0f * d : half_to_float(blk + 2);
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (QT == Q4_0 ? 2 : 4)));
#if TM_VNNI
    // The block's 16 possible weights d * i + m as a table, looked up by vpermps, which reads only the low 4 bits
    // of each index: the widened bytes index by their low nibble, shifted right by 4 by their high one.
    const __m512 table = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_ps(d), _mm512_set1_ps(m));
    const __m512i bytes = _mm512_cvtepu8_epi32(q);
    w[0] = _mm512_permutexvar_ps(bytes, table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
#else
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(q, mask), hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
    const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), dv, mv);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), dv, mv);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), dv, mv);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), dv, mv);
#endif
  }
}
#endif

// One weight row against NT activation rows: block pairs with C accumulator chains per row (more at one row, to
// hide the FMA latency), a block's vectors taking chains (j * kPer + i) % C.
template <int NT, int QT>
void row_float(const uint8_t* row, int64_t nb, const float* x, int64_t ldx, float* out) {
  constexpr int E = block_elems(QT), kBytes = block_bytes(QT);
  constexpr int kPer = E / kW, C = NT == 1 ? 4 : 2;
  FV acc[NT][C];
  for (auto& r : acc)
    for (auto& v : r) v = fv_zero();
  alignas(64) float buf[256];
  auto block = [&](int64_t b, auto j_constant) {
    constexpr int j = decltype(j_constant)::value;
    const uint8_t* blk = row + b * kBytes;
#if TM_ISA_X86
    if constexpr (QT == Q4_0 || QT == Q4_1 || QT == Q8_0) {
      FV wv[kPer];
      dequantize_32<QT>(blk, wv);
      for (int i = 0; i < kPer; ++i)
        for (int t = 0; t < NT; ++t)
          acc[t][(j * kPer + i) % C] = fv_fma(wv[i], fv_load(x + t * ldx + b * E + i * kW), acc[t][(j * kPer + i) % C]);
      return;
    }
#endif
    dequantize_block<QT>(blk, buf);
    for (int i = 0; i < kPer; ++i) {
      const FV wv = fv_load(buf + i * kW);
      for (int t = 0; t < NT; ++t)
        acc[t][(j * kPer + i) % C] = fv_fma(wv, fv_load(x + t * ldx + b * E + i * kW), acc[t][(j * kPer + i) % C]);
    }
  };
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    block(b, std::integral_constant<int, 0>{});
    block(b + 1, std::integral_constant<int, 1>{});
  }
  if (b < nb) block(b, std::integral_constant<int, 0>{});
  for (int t = 0; t < NT; ++t) {
    FV total = acc[t][0];
    for (int c = 1; c < C; ++c) total = fv_add(total, acc[t][c]);
    out[t] = fv_sum(total);
  }
}

template <int QT>
void float_tile_rows(const uint8_t* w, int64_t row_bytes, int64_t row_begin, int64_t row_end, const float* x,
                     int64_t ldx, int64_t K, int64_t T, float* y, int64_t ldy) {
  const int64_t nb = K / block_elems(QT);
  float out[4];
  for (int64_t t0 = 0; t0 < T; t0 += 4) {
    const int64_t nt = std::min<int64_t>(4, T - t0);
    const float* xt = x + t0 * ldx;
    for (int64_t n = row_begin; n < row_end; ++n) {
      const uint8_t* row = w + n * row_bytes;
      switch (nt) {
        case 4: row_float<4, QT>(row, nb, xt, ldx, out); break;
        case 3: row_float<3, QT>(row, nb, xt, ldx, out); break;
        case 2: row_float<2, QT>(row, nb, xt, ldx, out); break;
        default: row_float<1, QT>(row, nb, xt, ldx, out); break;
      }
      for (int64_t t = 0; t < nt; ++t) y[(t0 + t) * ldy + n] = out[t];
    }
  }
}

void run_float_tile(int qtype, const uint8_t* w, int64_t row_bytes, int64_t row_begin, int64_t row_end,
                    const float* x, int64_t ldx, int64_t K, int64_t T, float* y, int64_t ldy) {
  switch (qtype) {
    case Q4_0: float_tile_rows<Q4_0>(w, row_bytes, row_begin, row_end, x, ldx, K, T, y, ldy); break;
    case Q4_1: float_tile_rows<Q4_1>(w, row_bytes, row_begin, row_end, x, ldx, K, T, y, ldy); break;
    case Q8_0: float_tile_rows<Q8_0>(w, row_bytes, row_begin, row_end, x, ldx, K, T, y, ldy); break;
    case Q4_K: float_tile_rows<Q4_K>(w, row_bytes, row_begin, row_end, x, ldx, K, T, y, ldy); break;
    case Q5_K: float_tile_rows<Q5_K>(w, row_bytes, row_begin, row_end, x, ldx, K, T, y, ldy); break;
    case Q6_K: float_tile_rows<Q6_K>(w, row_bytes, row_begin, row_end, x, ldx, K, T, y, ldy); break;
    case Q5_0: float_tile_rows<Q5_0>(w, row_bytes, row_begin, row_end, x, ldx, K, T, y, ldy); break;
    case Q5_1: float_tile_rows<Q5_1>(w, row_bytes, row_begin, row_end, x, ldx, K, T, y, ldy); break;
    case IQ4_NL: float_tile_rows<IQ4_NL>(w, row_bytes, row_begin, row_end, x, ldx, K, T, y, ldy); break;
    case Q2_K: float_tile_rows<Q2_K>(w, row_bytes, row_begin, row_end, x, ldx, K, T, y, ldy); break;
    case Q3_K: float_tile_rows<Q3_K>(w, row_bytes, row_begin, row_end, x, ldx, K, T, y, ldy); break;
    default: break;
  }
}


// ---------------------------------------------------------------- read bandwidth, for scripts/bench_gguf_gemv.py
// The 64-bit lane sum of `bytes` bytes read as STREAMS equal parts side by side (a cache line of each in turn, so the
// core keeps STREAMS independent sequential streams in flight), with a software prefetch `prefetch` bytes ahead of
// each stream where prefetch > 0. x86: plain 32-byte (AVX2) or 64-byte (AVX-512) loads added as 64-bit lanes; the
// portable version: 64-bit words. The bench takes the fastest of several such loops as the bound a GEMV can reach.
template <int STREAMS>
uint64_t read_streams(const uint8_t* p, int64_t bytes, int64_t prefetch) {
  const int64_t part = bytes / STREAMS / 64 * 64;
#if TM_ISA_X86 && TM_VNNI
  __m512i acc[STREAMS];
  for (auto& v : acc) v = _mm512_setzero_si512();
#elif TM_ISA_X86
  __m256i acc[STREAMS][2];
  for (auto& v : acc) v[0] = v[1] = _mm256_setzero_si256();
#else
  uint64_t acc[STREAMS][8] = {};
#endif
  for (int64_t i = 0; i < part; i += 64) {
    for (int s = 0; s < STREAMS; ++s) {
      const uint8_t* line = p + s * part + i;
#if TM_ISA_X86
      if (prefetch > 0) _mm_prefetch(reinterpret_cast<const char*>(line + prefetch), _MM_HINT_T0);
#if TM_VNNI
      acc[s] = _mm512_add_epi64(acc[s], _mm512_loadu_si512(line));
#else
      acc[s][0] = _mm256_add_epi64(acc[s][0], load32(line));
      acc[s][1] = _mm256_add_epi64(acc[s][1], load32(line + 32));
#endif
#else
      if (prefetch > 0) __builtin_prefetch(line + prefetch);
      uint64_t words[8];
      std::memcpy(words, line, 64);
      for (int j = 0; j < 8; ++j) acc[s][j] += words[j];
#endif
    }
  }
  uint64_t total = 0;
  for (int s = 0; s < STREAMS; ++s) {
    uint64_t lanes[8];
#if TM_ISA_X86 && TM_VNNI
    _mm512_storeu_si512(lanes, acc[s]);
#elif TM_ISA_X86
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi64(acc[s][0], acc[s][1]));
    lanes[4] = lanes[5] = lanes[6] = lanes[7] = 0;
#else
    std::memcpy(lanes, acc[s], sizeof lanes);
#endif
    for (uint64_t v : lanes) total += v;
  }
  return total;
}

uint64_t read_sum(const uint8_t* p, int64_t bytes, int streams, int64_t prefetch) {
  switch (streams) {
    case 8: return read_streams<8>(p, bytes, prefetch);
    case 4: return read_streams<4>(p, bytes, prefetch);
    case 2: return read_streams<2>(p, bytes, prefetch);
    default: return read_streams<1>(p, bytes, prefetch);
  }
}

#endif  // TM_GGUF_BODY
