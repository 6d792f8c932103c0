// The mixed-adapter LoRA update of one (fused) linear layer on the CPU, in one call: every token's
// out[t] += (x[t] @ A[slot]^T) @ B[slot]^T, tokens grouped by slot, all slices of a fused qkv / gate-up at once.
//
// Built and loaded by kernels/lora_cpu.py through cpu_ops.build (g++ -O3 -march=native -fopenmp, a plain C ABI on raw
// pointers). It replaces the torch code of workers/lora/punica.py's grouped path (a dozen small ops per layer, each
// with its own dispatch and intermediate tensor) and keeps its FLOPs: each slot's A and B multiply only that slot's
// tokens, base-model tokens are never touched.
//
// Layouts (float32, bfloat16 or float16, dtype codes 0, 1, 2: one dtype for x and out, one for A and B, which may
// differ, as the slots of `--lora-dtype bfloat16` under float32 activations; accumulation in float32):
//   x [T, in] rows `x_stride` apart; out [T, out_features] rows `out_stride` apart, added to in place.
//   a [S, n * R, in] contiguous: slice i of slot s owns rows [i * R, (i + 1) * R) (zero past the adapter's rank).
//   b [S, R * out_features]: slot s's slice i (B transposed, the scale folded in) fills offsets [R * first_i,
//     R * (first_i + width_i)), where the slice's output columns are [first_i, first_i + width_i) and
//     slice_columns = {first_0, first_1, ..., first_n = out_features}; within it, tiles of kTileColumns columns one
//     after another, each a contiguous [R, tile width] block (the last tile narrower where the width is not a
//     multiple), so the expand reads B front to back (row by row over the whole slice, its R rows were R streams
//     a slice's width apart: with the prefetches below, a decode step's update over SmolLM2's 30 layers, 4 slots of
//     rank 16, went from ~15 to 21-22 GB/s of slot weights).
//   order [L]: the adapter tokens sorted by slot; slot_offsets [S + 1]: slot s's tokens are order[offsets[s]:
//     offsets[s + 1]] (L = offsets[S]; tokens of the base model appear nowhere).
// Work is split into items of (slot, slice, a run of the slot's tokens), each its own shrink and expand: no barrier
// inside a call (see `Item`); the runs are short enough that a step of few tokens still spreads over the threads.

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
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

inline void store(float* p, float x) { *p = x; }
inline void store(_Float16* p, float x) { *p = static_cast<_Float16>(x); }
inline void store(bf16* p, float x) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    p->bits = static_cast<uint16_t>((bits >> 16) | 0x40u);  // NaN
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  p->bits = static_cast<uint16_t>(bits >> 16);
}

// The micro-kernels keep their accumulators in `vf`: sixteen float32 lanes (one AVX-512 register) where the target
// has AVX-512, else eight (one AVX register; two SSE/NEON ones). The update is compute-bound at rank 16 (bfloat16
// slots, half the bytes, ran no faster), so the wider vectors halve its instruction count.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef uint16_t vu16 __attribute__((vector_size(2 * kLanes)));
typedef uint32_t vu32 __attribute__((vector_size(4 * kLanes)));
typedef _Float16 vf16 __attribute__((vector_size(2 * kLanes)));

inline vf load_lanes(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
// bfloat16 is float32's upper half: widen and shift as one vector (a loop over the lanes does not vectorize).
inline vf load_lanes(const bf16* p) {
  vu16 half;
  std::memcpy(&half, p, sizeof half);
  const vu32 bits = __builtin_convertvector(half, vu32) << 16;
  vf v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
inline vf load_lanes(const _Float16* p) {  // F16C's vcvtph2ps where the target has it
  vf16 half;
  std::memcpy(&half, p, sizeof half);
  return __builtin_convertvector(half, vf);
}

// The lanes' sum as a tree of halves (log2 kLanes shuffles and adds): a lane-by-lane loop is kLanes dependent scalar
// adds, which the shrink paid for every (token, rank) pair: as much time as the dot products at 576 inputs.
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
inline float sum_lanes(vf v) {
#if defined(__AVX512F__)
  const vf8 v8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const vf8 v8 = v;
#endif
  const vf4 v4 = __builtin_shufflevector(v8, v8, 0, 1, 2, 3) + __builtin_shufflevector(v8, v8, 4, 5, 6, 7);
  return (v4[0] + v4[2]) + (v4[1] + v4[3]);
}

// Asks for [p, p + count) ahead of its use: an item's A and B are short streams (tens of KiB each, two per item, a
// few thousand per decode step), too short for the hardware prefetcher to ramp up on before each ends.
template <typename W>
inline void prefetch_lines(const W* p, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(p);
  const int64_t size = count * static_cast<int64_t>(sizeof(W));
  for (int64_t offset = 0; offset < size; offset += 64) __builtin_prefetch(bytes + offset);
}

constexpr int64_t kTokenBlock = 4;          // tokens sharing each load of the A rows in the shrink
constexpr int64_t kColumnBlock = 4 * kLanes;  // output columns of one expand block (four vf per token)
constexpr int64_t kTileColumns = 64;        // B's tile width (lora_cpu.py's B_TILE_COLUMNS): one or two blocks
static_assert(kTileColumns % kColumnBlock == 0, "a tile is whole blocks");
constexpr int64_t kParallelMacs = 1 << 18;  // below this a layer's update runs on one thread: a fork costs more

struct Problem {
  int64_t in_features, out_features, rank, num_slices, num_slots;
  const int64_t* slice_columns;  // [num_slices + 1]
  const int64_t* order;          // [L]
  const int64_t* offsets;        // [num_slots + 1]
  int64_t ranks() const { return num_slices * rank; }
};

// sums[r][q] = x_r . a_q over n inputs, for kRows token rows x_r and two A rows a_q: 2 * kRows accumulators, each
// load of an A or x vector used two or kRows times. A run's last few tokens take the smaller instances (a decode
// step's slot group is often a single token: no rows computed twice). Inlined: called through `dot_rows`, the
// four-row instance ran at two thirds of its inlined speed.
template <int64_t kRows, typename T, typename W>
__attribute__((always_inline)) inline void dot_block(const T* const* x, const W* a0, const W* a1, int64_t n,
                                                     float sums[kTokenBlock][2]) {
  vf acc[kRows][2] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vf w0 = load_lanes(a0 + i), w1 = load_lanes(a1 + i);
    for (int64_t r = 0; r < kRows; ++r) {
      const vf v = load_lanes(x[r] + i);
      acc[r][0] += v * w0;
      acc[r][1] += v * w1;
    }
  }
  for (int64_t r = 0; r < kRows; ++r) {
    sums[r][0] = sum_lanes(acc[r][0]);
    sums[r][1] = sum_lanes(acc[r][1]);
    for (int64_t k = i; k < n; ++k) {
      sums[r][0] += to_float(x[r][k]) * to_float(a0[k]);
      sums[r][1] += to_float(x[r][k]) * to_float(a1[k]);
    }
  }
}

// A run's last `count` < kTokenBlock rows.
template <typename T, typename W>
void dot_rows(int64_t count, const T* const* x, const W* a0, const W* a1, int64_t n, float sums[kTokenBlock][2]) {
  static_assert(kTokenBlock == 4, "one instance per row count");
  if (count == 1)
    dot_block<1>(x, a0, a1, n, sums);
  else if (count == 2)
    dot_block<2>(x, a0, a1, n, sums);
  else
    dot_block<3>(x, a0, a1, n, sums);
}

// h[k - k0, j] and h[k - k0, j + 1] = x[order[k]] . a[j or j + 1] for the tokens k0 <= k < k1 (h rows `rank` apart;
// a second row only where j + 1 < rank).
template <typename T, typename W>
void shrink_rows(const Problem& p, const T* x, int64_t x_stride, const W* a, float* h, int64_t k0, int64_t k1,
                 int64_t j) {
  const int64_t n = p.in_features;
  const bool pair = j + 1 < p.rank;
  const W* a0 = a + j * n;
  const W* a1 = pair ? a0 + n : a0;
  if (j + 2 < p.rank) prefetch_lines(a0 + 2 * n, std::min<int64_t>(2, p.rank - j - 2) * n);  // the next pair's rows
  for (int64_t k = k0; k < k1; k += kTokenBlock) {
    const int64_t count = std::min(kTokenBlock, k1 - k);
    const T* rows[kTokenBlock];
    for (int64_t r = 0; r < count; ++r) rows[r] = x + p.order[k + r] * x_stride;
    float sums[kTokenBlock][2];
    if (count == kTokenBlock)
      dot_block<kTokenBlock>(rows, a0, a1, n, sums);
    else
      dot_rows(count, rows, a0, a1, n, sums);
    for (int64_t r = 0; r < count; ++r) {
      h[(k - k0 + r) * p.rank + j] = sums[r][0];
      if (pair) h[(k - k0 + r) * p.rank + j + 1] = sums[r][1];
    }
  }
}

// acc[t][c] = sum_j h_t[j] * b[j * stride + c] over a block's kColumnBlock columns, for two tokens' h rows
// (`expand_one`: a run's last odd token): eight vf accumulators, each load of a B vector used twice.
template <typename W>
void expand_pair(const float* h0, const float* h1, const W* b, int64_t stride, int64_t rank, vf acc[2][4]) {
  for (int64_t j = 0; j < rank; ++j) {
    const W* b_row = b + j * stride;
    const vf w[4] = {load_lanes(b_row), load_lanes(b_row + kLanes), load_lanes(b_row + 2 * kLanes),
                     load_lanes(b_row + 3 * kLanes)};
    for (int q = 0; q < 4; ++q) {
      acc[0][q] += h0[j] * w[q];
      acc[1][q] += h1[j] * w[q];
    }
  }
}

template <typename W>
void expand_one(const float* h0, const W* b, int64_t stride, int64_t rank, vf acc[2][4]) {
  for (int64_t j = 0; j < rank; ++j) {
    const W* b_row = b + j * stride;
    for (int q = 0; q < 4; ++q) acc[0][q] += h0[j] * load_lanes(b_row + kLanes * q);
  }
}

template <typename T>
void add_row(T* out, const float* acc, int64_t columns) {
  for (int64_t c = 0; c < columns; ++c) store(out + c, to_float(out[c]) + acc[c]);
}

// out[order[k], column + c] += sum_j h[k - k0, j] * tile[j, c] for the tokens k0 <= k < k1 and the tile's `width`
// columns (its rows `width` apart): blocks of kColumnBlock columns (each read once from memory and then from L1 for
// every token pair), two tokens at a time in registers, a narrower last tile's partial block column by column.
template <typename T, typename W>
void expand_tile(const Problem& p, const float* h, const W* tile, int64_t width, T* out, int64_t out_stride,
                 int64_t k0, int64_t k1, int64_t column) {
  for (int64_t c0 = 0; c0 < width; c0 += kColumnBlock) {
    const int64_t columns = std::min(kColumnBlock, width - c0);
    const W* block = tile + c0;  // row j at block + j * width
    for (int64_t k = k0; k < k1; k += 2) {
      const int64_t count = std::min<int64_t>(2, k1 - k);
      const float* hs[2] = {h + (k - k0) * p.rank, h + (k + count - 1 - k0) * p.rank};
      alignas(64) float acc[2][kColumnBlock] = {};
      if (columns == kColumnBlock) {
        vf vacc[2][4] = {};
        if (count == 2)
          expand_pair(hs[0], hs[1], block, width, p.rank, vacc);
        else
          expand_one(hs[0], block, width, p.rank, vacc);
        std::memcpy(acc, vacc, sizeof acc);
      } else {
        for (int64_t j = 0; j < p.rank; ++j)
          for (int64_t r = 0; r < count; ++r)
            for (int64_t c = 0; c < columns; ++c) acc[r][c] += hs[r][j] * to_float(block[j * width + c]);
      }
      for (int64_t r = 0; r < count; ++r) add_row(out + p.order[k + r] * out_stride + column + c0, acc[r], columns);
    }
  }
}

// out[order[k], first + c] += sum_j h[k - k0, j] * B_slice[j, c] for the tokens k0 <= k < k1 and every column of the
// slice, tile by tile, the next tile asked for while this one runs.
template <typename T, typename W>
void expand_rows(const Problem& p, const float* h, const W* b_slice, T* out, int64_t out_stride, int64_t k0,
                 int64_t k1, int64_t first, int64_t width) {
  for (int64_t tile = 0; tile < width; tile += kTileColumns) {
    const int64_t next = tile + kTileColumns;
    if (next < width) prefetch_lines(b_slice + p.rank * next, p.rank * std::min(kTileColumns, width - next));
    const int64_t tile_width = std::min(kTileColumns, width - tile);
    expand_tile(p, h, b_slice + p.rank * tile, tile_width, out, out_stride, k0, k1, first + tile);
  }
}

// One work item: a run of one slot's tokens through one slice, shrink then expand, independent of every other item
// (its own output columns or its own tokens), so a layer's update needs no barrier between its phases: one fork and
// one join per call, which is what a decode step's many small updates pay most for on a busy machine.
struct Item {
  int64_t slot, slice, k0, k1;
};

// The items of a call: every used slot's tokens in runs of `chunk` tokens (a multiple of kTokenBlock, about four
// items per thread in all, so dynamic scheduling evens out slices of unequal widths), times every slice.
std::vector<Item> work_items(const Problem& p, int64_t num_threads) {
  const int64_t num_tokens = p.offsets[p.num_slots];
  const int64_t target = std::max<int64_t>(1, 4 * num_threads);
  int64_t chunk = (num_tokens * p.num_slices + target - 1) / target;
  chunk = std::max<int64_t>(2 * kTokenBlock, (chunk + kTokenBlock - 1) / kTokenBlock * kTokenBlock);
  std::vector<Item> items;
  for (int64_t s = 0; s < p.num_slots; ++s)
    for (int64_t k0 = p.offsets[s]; k0 < p.offsets[s + 1]; k0 += chunk)
      for (int64_t i = 0; i < p.num_slices; ++i) items.push_back({s, i, k0, std::min(k0 + chunk, p.offsets[s + 1])});
  return items;
}

template <typename T, typename W>
void run_item(const Problem& p, const Item& item, const T* x, int64_t x_stride, T* out, int64_t out_stride, const W* a,
              const W* b, std::vector<float>& h) {
  h.resize((item.k1 - item.k0) * p.rank);
  const W* a_slice = a + (item.slot * p.ranks() + item.slice * p.rank) * p.in_features;
  for (int64_t j = 0; j < p.rank; j += 2) shrink_rows(p, x, x_stride, a_slice, h.data(), item.k0, item.k1, j);
  const int64_t first = p.slice_columns[item.slice], width = p.slice_columns[item.slice + 1] - first;
  const W* b_slice = b + item.slot * p.rank * p.out_features + p.rank * first;
  expand_rows(p, h.data(), b_slice, out, out_stride, item.k0, item.k1, first, width);
}

template <typename T, typename W>
void lora_add(const Problem& p, const T* x, int64_t x_stride, T* out, int64_t out_stride, const W* a, const W* b) {
  const int64_t num_tokens = p.offsets[p.num_slots];
  if (num_tokens == 0) return;
  const int64_t macs = num_tokens * (p.ranks() * p.in_features + p.rank * p.out_features);
  const bool parallel = macs > kParallelMacs && omp_get_max_threads() > 1;
  const std::vector<Item> items = work_items(p, parallel ? omp_get_max_threads() : 1);
  const int64_t count = static_cast<int64_t>(items.size());
#pragma omp parallel if (parallel)
  {
    std::vector<float> h;  // this thread's shrunk activations, float32 between shrink and expand
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t item = 0; item < count; ++item) run_item(p, items[item], x, x_stride, out, out_stride, a, b, h);
  }
}

// The weights' dtype (code 0, 1, 2) resolved for activations of type T; false for an unknown code.
template <typename T>
bool lora_add_weights_of(int weight_dtype, const Problem& p, const void* x, int64_t x_stride, void* out,
                         int64_t out_stride, const void* a, const void* b) {
  const T* xt = static_cast<const T*>(x);
  T* outt = static_cast<T*>(out);
  switch (weight_dtype) {
    case 0:
      lora_add(p, xt, x_stride, outt, out_stride, static_cast<const float*>(a), static_cast<const float*>(b));
      return true;
    case 1:
      lora_add(p, xt, x_stride, outt, out_stride, static_cast<const bf16*>(a), static_cast<const bf16*>(b));
      return true;
    case 2:
      lora_add(p, xt, x_stride, outt, out_stride, static_cast<const _Float16*>(a), static_cast<const _Float16*>(b));
      return true;
    default:
      return false;
  }
}

}  // namespace

extern "C" {

// dtype: x's and out's; weight_dtype: a's and b's. Returns 0, or -1 for an unknown dtype code.
int tm_lora_add(int dtype, int weight_dtype, const void* x, int64_t x_stride, void* out, int64_t out_stride,
                const void* a, const void* b, int64_t in_features, int64_t out_features, int64_t rank,
                const int64_t* slice_columns, int64_t num_slices, const int64_t* order, const int64_t* slot_offsets,
                int64_t num_slots) {
  const Problem p{in_features, out_features, rank, num_slices, num_slots, slice_columns, order, slot_offsets};
  bool known = false;
  switch (dtype) {
    case 0:
      known = lora_add_weights_of<float>(weight_dtype, p, x, x_stride, out, out_stride, a, b);
      break;
    case 1:
      known = lora_add_weights_of<bf16>(weight_dtype, p, x, x_stride, out, out_stride, a, b);
      break;
    case 2:
      known = lora_add_weights_of<_Float16>(weight_dtype, p, x, x_stride, out, out_stride, a, b);
      break;
    default:
      break;
  }
  return known ? 0 : -1;
}

}  // extern "C"
