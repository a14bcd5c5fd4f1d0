// The CPU reference's bf16 and e4m3 rounding must be bit-exact with the
// hardware conversions the kernels will use (cvt.rn.bf16.f32 and
// cvt.rn.satfinite.e4m3x2.f32). Skipped when no CUDA device is visible.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "core/fp8_scale.h"
#include "cuda/fp8/e4m3.cuh"
#include "reference/numerics.h"
#include "testing/random_layer.h"

namespace {

using namespace megamoe;

#define CUDA_OK(expr)                                                              \
  do {                                                                             \
    const cudaError_t e_ = (expr);                                                 \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_);         \
  } while (0)

bool have_gpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

__global__ void convert_kernel(const float* in, uint16_t* bf16_out, uint8_t* e4m3_out, float* e4m3_decoded,
                               int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const __nv_bfloat16 b = __float2bfloat16_rn(in[i]);
  bf16_out[i] = *reinterpret_cast<const uint16_t*>(&b);
  const __nv_fp8_storage_t q = __nv_cvt_float_to_fp8(in[i], __NV_SATFINITE, __NV_E4M3);
  e4m3_out[i] = q;
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(i & 0xFF), __NV_E4M3);
  e4m3_decoded[i] = __half2float(__half(h));
}

std::vector<float> test_inputs() {
  std::vector<float> v;
  // Every e4m3 value, the midpoints between neighbours, and a hair either side.
  for (int c = 0; c < 0x7E; ++c) {
    const float a = numerics::float_from_e4m3(static_cast<uint8_t>(c));
    const float b = numerics::float_from_e4m3(static_cast<uint8_t>(c + 1));
    const float mid = 0.5f * (a + b);
    for (float x : {a, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
      v.push_back(x);
      v.push_back(-x);
    }
  }
  for (float x : {448.0f, 449.0f, 464.0f, 480.0f, 1e6f, INFINITY, -INFINITY, NAN, 0.0f, -0.0f, 1e-30f, 3.4e38f})
    v.push_back(x);
  // bf16 ties and random floats over many binades.
  for (uint32_t hi = 0; hi < 0x10000; hi += 7) {
    uint32_t bits = (hi << 16) | 0x8000u;  // exact tie
    float f;
    std::memcpy(&f, &bits, 4);
    v.push_back(f);
    bits = (hi << 16) | 0x7FFFu;
    std::memcpy(&f, &bits, 4);
    v.push_back(f);
  }
  for (uint64_t i = 0; i < 200000; ++i) {
    const double m = megamoe::testing::uniform_pm1(5, 1, i);
    const int e = static_cast<int>(megamoe::testing::hash64(i) % 40) - 20;
    v.push_back(static_cast<float>(std::ldexp(m, e)));
  }
  return v;
}

// The quantizers' per-tile arithmetic (cuda/fp8/e4m3.cuh) on the device
// against the division it replaces, for every bf16 amax (block b: amax of
// bf16 bits b, NaNs and inf included) and every bf16 value of such a tile
// (|v| <= amax; any value when amax is not finite), both scale kinds:
// counts[kind]: tile_scale differs from fp8_scale_fp32 / fp8_scale_pow2;
// counts[2 + kind]: E4m3Quotients::pack8's code differs from to_e4m3's;
// counts[4]: the same with fp32 tiles of amax < 2^-96 forced onto the fast
// path (the control: the fallback there is needed, so the test can fail).
__global__ void quotient_kernel(unsigned long long* counts) {
  using cuda::Fp8Scale;
  const uint32_t ab = blockIdx.x;
  const float amax = __uint_as_float(ab << 16);
  const bool finite = ab < 0x7F80u;
  for (int kind = 0; kind < 2; ++kind) {
    const Fp8Scale k = kind == 0 ? Fp8Scale::kFloat32 : Fp8Scale::kPowerOfTwo;
    const float s = cuda::fp8::tile_scale(amax, k);
    const float want_s = kind == 0 ? fp8_scale_fp32(amax) : fp8_scale_pow2(amax);
    if (threadIdx.x == 0 && __float_as_uint(s) != __float_as_uint(want_s)) atomicAdd(&counts[kind], 1ull);
    const cuda::fp8::E4m3Quotients by(s, amax, k);
    cuda::fp8::E4m3Quotients forced = by;
    forced.fast = true;
    const bool control = kind == 0 && finite && amax < 0x1p-96f;
    unsigned long long wrong = 0, forced_wrong = 0;
    for (uint32_t g = threadIdx.x; g < 8192; g += blockDim.x) {
      float v[8];
      for (int i = 0; i < 8; ++i) {
        const float x = __uint_as_float((g * 8 + i) << 16);
        v[i] = finite && !(fabsf(x) <= amax) ? 0.0f : x;
      }
      const uint2 p = by.pack8(v), pf = forced.pack8(v);
      for (int i = 0; i < 8; ++i) {
        const uint32_t want = cuda::fp8::to_e4m3(v[i], s);
        wrong += (((i < 4 ? p.x : p.y) >> (8 * (i % 4))) & 0xFFu) != want;
        forced_wrong += control && (((i < 4 ? pf.x : pf.y) >> (8 * (i % 4))) & 0xFFu) != want;
      }
    }
    if (wrong > 0) atomicAdd(&counts[2 + kind], wrong);
    if (forced_wrong > 0) atomicAdd(&counts[4], forced_wrong);
  }
}

TEST(GpuNumerics, QuantizerQuotientsAreTheDivisionsCodes) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device visible";
  unsigned long long* d_counts;
  CUDA_OK(cudaMalloc(&d_counts, 5 * sizeof(unsigned long long)));
  CUDA_OK(cudaMemset(d_counts, 0, 5 * sizeof(unsigned long long)));
  quotient_kernel<<<0x8000, 256>>>(d_counts);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaDeviceSynchronize());
  unsigned long long counts[5];
  CUDA_OK(cudaMemcpy(counts, d_counts, sizeof counts, cudaMemcpyDeviceToHost));
  cudaFree(d_counts);
  EXPECT_EQ(counts[0], 0u) << "fp32 scales differ from fp8_scale_fp32";
  EXPECT_EQ(counts[1], 0u) << "pow2 scales differ from fp8_scale_pow2";
  EXPECT_EQ(counts[2], 0u) << "fp32 codes differ from the division's";
  EXPECT_EQ(counts[3], 0u) << "pow2 codes differ from the division's";
  EXPECT_GT(counts[4], 0u) << "the fast path is right on tiny tiles too: the control cannot fail";
}

TEST(GpuNumerics, ReferenceRoundingMatchesHardwareConversions) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device visible";
  const std::vector<float> in = test_inputs();
  const int n = static_cast<int>(in.size());
  float *d_in, *d_dec;
  uint16_t* d_bf;
  uint8_t* d_q;
  CUDA_OK(cudaMalloc(&d_in, n * sizeof(float)));
  CUDA_OK(cudaMalloc(&d_bf, n * sizeof(uint16_t)));
  CUDA_OK(cudaMalloc(&d_q, n));
  CUDA_OK(cudaMalloc(&d_dec, n * sizeof(float)));
  CUDA_OK(cudaMemcpy(d_in, in.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  convert_kernel<<<(n + 255) / 256, 256>>>(d_in, d_bf, d_q, d_dec, n);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint16_t> bf(n);
  std::vector<uint8_t> q(n);
  std::vector<float> dec(n);
  CUDA_OK(cudaMemcpy(bf.data(), d_bf, n * sizeof(uint16_t), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(q.data(), d_q, n, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(dec.data(), d_dec, n * sizeof(float), cudaMemcpyDeviceToHost));
  cudaFree(d_in);
  cudaFree(d_bf);
  cudaFree(d_q);
  cudaFree(d_dec);

  int bf_bad = 0, q_bad = 0;
  for (int i = 0; i < n; ++i) {
    const uint16_t ref_bf = numerics::bf16_bits_from_float(in[i]);
    const bool nan_both = std::isnan(in[i]) && ((bf[i] & 0x7F80) == 0x7F80) && (bf[i] & 0x7F);
    if (bf[i] != ref_bf && !nan_both && bf_bad++ < 5)
      ADD_FAILURE() << "bf16(" << in[i] << "): hw " << std::hex << bf[i] << " ref " << ref_bf;
    const uint8_t ref_q = numerics::e4m3_from_float(in[i]);
    const bool qnan_both = std::isnan(in[i]) && (q[i] & 0x7F) == 0x7F;
    if (q[i] != ref_q && !qnan_both && q_bad++ < 5)
      ADD_FAILURE() << "e4m3(" << in[i] << "): hw 0x" << std::hex << int(q[i]) << " ref 0x" << int(ref_q);
  }
  EXPECT_EQ(bf_bad, 0);
  EXPECT_EQ(q_bad, 0);
  for (int c = 0; c < 256; ++c) {
    const float ref = numerics::float_from_e4m3(static_cast<uint8_t>(c));
    if (std::isnan(ref)) EXPECT_TRUE(std::isnan(dec[c])) << c;
    else EXPECT_EQ(dec[c], ref) << "code " << c;
  }
}

}  // namespace
