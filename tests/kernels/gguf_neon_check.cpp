// The NEON version of kernels/gguf_cpu.cpp against its portable version, on AArch64 (tests/kernels/
// test_gguf_cpu_kernels.py cross-compiles this and runs it under qemu-aarch64 where both are installed). Both see the
// same int8 activations (or, for tm_gguf_matmul_float, the same float ones), so they must agree to float rounding;
// the portable version itself is checked against float64 references on every machine. Exit status 0 when every type,
// batch and activation mode agrees.
#include "gguf_cpu.cpp"
#include <cstdio>
#include <random>
int main() {
  std::mt19937 g(1);
  const int types[] = {2, 3, 6, 7, 8, 20, 10, 11, 12, 13, 14};  // Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 IQ4_NL Q2_K..Q6_K
  int failures = 0;
  for (int qtype : types) {
    const int64_t K = 3 * block_elems(qtype), N = 37;
    const int bb = block_bytes(qtype), nb = K / block_elems(qtype);
    std::vector<uint8_t> w(N * nb * bb);
    for (auto& v : w) v = g() & 0xff;
    // finite fp16 scales: 0x1c00-ish (about 0.004) with random low bits and sign
    auto set_half = [&](uint8_t* p) { uint16_t h = 0x1800 | (g() & 0x3ff) | ((g() & 1) << 15); std::memcpy(p, &h, 2); };
    for (int64_t r = 0; r < N; ++r)
      for (int b = 0; b < nb; ++b) {
        uint8_t* blk = w.data() + (r * nb + b) * bb;
        if (qtype == 14) set_half(blk + 208);
        else if (qtype == 11) set_half(blk + 108);
        else if (qtype == 10) { set_half(blk + 80); set_half(blk + 82); }
        else { set_half(blk); if (qtype == 3 || qtype == 7 || qtype == 12 || qtype == 13) set_half(blk + 2); }
      }
    for (int64_t T : {1, 2, 3, 7, 32}) {
      std::vector<float> x(T * K), y0(T * N), y1(T * N);
      for (auto& v : x) v = std::normal_distribution<float>()(g);
      for (int float_act : {0, 1}) {  // the int8-activation and the float-activation paths
        tm_gguf_set_isa(0);
        if (float_act) tm_gguf_matmul_float(qtype, x.data(), K, w.data(), T, N, K, y0.data(), N);
        else tm_gguf_matmul(qtype, 0, x.data(), K, w.data(), T, N, K, y0.data(), N);
        if (tm_gguf_set_isa(1) != 0) { printf("no neon\n"); return 1; }
        if (float_act) tm_gguf_matmul_float(qtype, x.data(), K, w.data(), T, N, K, y1.data(), N);
        else tm_gguf_matmul(qtype, 0, x.data(), K, w.data(), T, N, K, y1.data(), N);
        double worst = 0, scale = 0;
        for (size_t i = 0; i < y0.size(); ++i) { worst = std::max(worst, (double)std::fabs(y0[i] - y1[i])); scale = std::max(scale, (double)std::fabs(y0[i])); }
        const bool ok = worst <= 1e-5 * scale + 1e-30 && scale > 0;
        failures += !ok;
        printf("type %2d T %2ld %s: max|neon - scalar| = %.3g (max|y| %.3g) %s\n", qtype, (long)T,
               float_act ? "float" : "int8 ", worst, scale, ok ? "ok" : "FAIL");
      }
    }
  }
  printf("active isa %d, failures %d\n", tm_gguf_isa(), failures);
  return failures != 0;
}
