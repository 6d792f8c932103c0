// Replays a recorded list of kernel calls (workers/cpu_graphs.py) in one native loop, so that a batch-1 decode step's
// few hundred calls into cpu_ops.so and gguf_cpu.so cost no Python and no ctypes argument conversion each.
//
// Every recorded function returns int and takes integer-class arguments (pointers, int64, int32) and at most
// MAX_FLOATS float ones. The x86-64 System V and Linux AArch64 calling conventions assign the two classes
// independently: the first integer arguments to integer registers, the first eight float ones to vector registers,
// and the integer ones left over to 8-byte stack slots in their order. So one call through a prototype of MAX_INTS
// int64 and MAX_FLOATS float parameters, with a function's integer arguments first in their order (each widened to
// 64 bits) and its float ones in theirs, puts every argument where that function reads it; the unused trailing ones
// are the caller's to clean up. call_replay.py enables this only on those two platforms and checks each function's
// argument types when it builds the table.

#include <cstdint>
#include <ctime>

namespace {

constexpr int MAX_INTS = 24;
constexpr int MAX_FLOATS = 8;

struct ReplayCall {
  void* function;
  int64_t ints[MAX_INTS];
  float floats[MAX_FLOATS];
};

typedef int (*GenericKernel)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                             int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                             int64_t, int64_t, int64_t, int64_t, int64_t, float, float, float, float, float, float,
                             float, float);

inline int call(const ReplayCall& c) {
  const int64_t* i = c.ints;
  const float* f = c.floats;
  return reinterpret_cast<GenericKernel>(c.function)(i[0], i[1], i[2], i[3], i[4], i[5], i[6], i[7], i[8], i[9],
                                                      i[10], i[11], i[12], i[13], i[14], i[15], i[16], i[17], i[18],
                                                      i[19], i[20], i[21], i[22], i[23], f[0], f[1], f[2], f[3],
                                                      f[4], f[5], f[6], f[7]);
}

inline int64_t now_ns(clockid_t clock) {
  timespec t;
  clock_gettime(clock, &t);
  return t.tv_sec * 1000000000LL + t.tv_nsec;
}

}  // namespace

extern "C" {

int tm_replay_layout(int64_t* max_ints, int64_t* max_floats, int64_t* call_bytes) {
  *max_ints = MAX_INTS;
  *max_floats = MAX_FLOATS;
  *call_bytes = sizeof(ReplayCall);
  return 0;
}

// Runs calls[0..n) in order and returns n, or the index of the first call that returned nonzero (the calls after it
// are not run). With `nanos` given, nanos[k] gets call k's time in nanoseconds on clock `clock_id` (a clockid_t:
// CLOCK_MONOTONIC, or CLOCK_THREAD_CPUTIME_ID, which leaves out time spent waiting for a core; for
// scripts/profile_token.py).
int64_t tm_replay_calls(const ReplayCall* calls, int64_t n, int64_t* nanos, int clock_id) {
  const clockid_t clock = static_cast<clockid_t>(clock_id);
  for (int64_t k = 0; k < n; ++k) {
    const int64_t started = nanos != nullptr ? now_ns(clock) : 0;
    const int status = call(calls[k]);
    if (nanos != nullptr) nanos[k] = now_ns(clock) - started;
    if (status != 0) return k;
  }
  return n;
}

}  // extern "C"
