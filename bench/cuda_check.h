// The C++ benchmarks' CUDA runtime check: a failing call prints the program,
// the call and the error, and exits with status 2 (a benchmark has no
// recovery to attempt). Each file names itself once:
//   #define CHECK_CUDA(x) MEGAMOE_BENCH_CHECK_CUDA("megamoe-gemm-bench", x)
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define MEGAMOE_BENCH_CHECK_CUDA(prog, x)                                       \
  do {                                                                          \
    const cudaError_t e_ = (x);                                                 \
    if (e_ != cudaSuccess) {                                                    \
      std::fprintf(stderr, "%s: %s: %s\n", prog, #x, cudaGetErrorString(e_));   \
      std::exit(2);                                                             \
    }                                                                           \
  } while (0)
