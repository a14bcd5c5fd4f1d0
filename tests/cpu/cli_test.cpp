// The megamoe command-line program: its table, its checks and its errors.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <string>
#include <sys/wait.h>
#include <unistd.h>

#include "cuda/device_query.h"
#include "megamoe/presets.h"

namespace {

struct Result {
  int status;
  std::string output;
};

// Runs the program; its output is stdout and stderr together, or stdout alone with stderr dropped.
Result run_cli(const std::string& args, bool stdout_only = false) {
  const std::string cmd = std::string(MEGAMOE_CLI_PATH) + " " + args + (stdout_only ? " 2>/dev/null" : " 2>&1");
  FILE* f = popen(cmd.c_str(), "r");
  Result r{-1, ""};
  if (!f) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), f)) > 0) r.output.append(buf.data(), n);
  const int raw = pclose(f);
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  return r;
}

bool has(const Result& r, const std::string& s) { return r.output.find(s) != std::string::npos; }

TEST(Cli, TinyRunPrintsTheTableAndPassesItsCheck) {
  const Result r = run_cli("run --preset tiny --tokens 100 --backend cpu");
  EXPECT_EQ(r.status, 0) << r.output;
  for (const char* s : {"forward", "backward", "fwd+bwd", "TFLOPS", "rel_err", "dw13", "backend: cpu: requested"})
    EXPECT_TRUE(has(r, s)) << s << "\n" << r.output;
  EXPECT_FALSE(has(r, " NO")) << r.output;
}

TEST(Cli, SimulatedRanksAndFp8) {
  const Result r = run_cli("run --preset tiny --tokens 64 --ep-size 2 --precision fp8 --save recompute");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(has(r, "EP 2, precision fp8, save recompute")) << r.output;
  // auto picks the cpu for simulated ranks, with or without a GPU, and says so
  EXPECT_TRUE(has(r, "--ep-size > 1 is simulated on the cpu reference")) << r.output;
  // an explicit cuda backend is refused, naming where expert parallelism on GPUs runs (or why cuda cannot run)
  const Result c = run_cli("run --preset tiny --tokens 64 --ep-size 2 --backend cuda");
  EXPECT_NE(c.status, 0) << c.output;
  EXPECT_TRUE(has(c, "megamoe-ep-bench") || has(c, "backend cuda:")) << c.output;
}

TEST(Cli, AutoSaysWhichBackendAndWhy) {
  const Result r = run_cli("run --preset tiny --tokens 16");
  EXPECT_EQ(r.status, 0) << r.output;
  std::string why;
  if (megamoe::cuda::device_count(&why) == 0) {
    EXPECT_TRUE(has(r, "backend: auto: using cpu (")) << r.output;
  } else {
    EXPECT_TRUE(has(r, "backend: auto: CUDA device found, using cuda")) << r.output;
    EXPECT_TRUE(has(r, "times: CUDA-event medians")) << r.output;
  }
}

TEST(Cli, BadOptionsExitWithUsage) {
  Result r = run_cli("run --preset huge");
  EXPECT_EQ(r.status, 2);
  EXPECT_TRUE(has(r, "unknown preset 'huge'")) << r.output;
  r = run_cli("run --tokens -5");
  EXPECT_EQ(r.status, 2);
  EXPECT_TRUE(has(r, "--tokens must be an integer >= 1")) << r.output;
  r = run_cli("run --precision fp16");
  EXPECT_EQ(r.status, 2);
  EXPECT_TRUE(has(r, "precision: unknown value 'fp16'")) << r.output;
  r = run_cli("run --ep-size 3 --preset tiny");
  EXPECT_EQ(r.status, 2);
  EXPECT_TRUE(has(r, "not divisible by ep_size = 3")) << r.output;
  r = run_cli("frobnicate");
  EXPECT_EQ(r.status, 2);
}

TEST(Cli, HelpGoesToStdoutWithStatusZero) {
  for (const char* args : {"--help", "-h", "run --help", "run --preset tiny -h"}) {
    const Result r = run_cli(args, /*stdout_only=*/true);
    EXPECT_EQ(r.status, 0) << args << "\n" << r.output;
    // Every preset, as the library names them (include/megamoe/presets.h).
    EXPECT_TRUE(has(r, "usage: megamoe run [--preset " + megamoe::preset_names() + "]")) << args << "\n" << r.output;
    EXPECT_TRUE(has(r, "tiny|qwen3-30b-a3b|qwen3-235b-a22b|")) << args << "\n" << r.output;
  }
  for (const char* args : {"", "frobnicate", "run --frobnicate 1"}) {
    const Result r = run_cli(args, /*stdout_only=*/true);
    EXPECT_EQ(r.status, 2) << args;
    EXPECT_EQ(r.output, "") << args;  // usage after a mistake goes to stderr
  }
}

// Token counts that overflow, cannot be allocated or are empty: one-line errors, exit 2, never a crash.
TEST(Cli, TokenCountsOutOfReachAreErrors) {
  const std::pair<const char*, const char*> cases[] = {
      {"4611686018427387904", "exceeds 2^30 routed rows per rank"},
      {"9223372036854775807", "exceeds 2^30 routed rows per rank"},
      {"9223372036854775808", "--tokens must be an integer >= 1"},  // beyond int64
      {"0", "--tokens must be an integer >= 1"},
      {"12x", "--tokens must be an integer >= 1"},
  };
  for (const auto& [tokens, message] : cases) {
    const Result r = run_cli(std::string("run --preset tiny --backend cpu --tokens ") + tokens);
    EXPECT_EQ(r.status, 2) << tokens << "\n" << r.output;
    EXPECT_TRUE(has(r, message)) << tokens << "\n" << r.output;
    EXPECT_FALSE(has(r, "rel_err")) << tokens << "\n" << r.output;
  }
  // Valid, but more host memory than any machine here has (2^27 tokens of H 4096: 4 TiB of host buffers).
  const Result r = run_cli("run --preset qwen3-235b-a22b --backend cpu --tokens 134217728");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_TRUE(has(r, "out of host memory")) << r.output;
}

TEST(Cli, CudaBackendRunsOrSaysWhyNot) {
  const Result r = run_cli("run --preset tiny --tokens 100 --backend cuda");
  std::string why;
  if (megamoe::cuda::device_count(&why) == 0) {
    EXPECT_EQ(r.status, 2) << r.output;
    EXPECT_TRUE(has(r, "backend cuda:")) << r.output;
    EXPECT_FALSE(has(r, "unknown device")) << r.output;  // nothing about a device that is not there
    EXPECT_FALSE(has(r, "megamoe run: preset")) << r.output;  // the error comes first, alone
    if (access("/proc/driver/nvidia/version", F_OK) != 0) {
      EXPECT_TRUE(has(r, "no CUDA GPU found")) << r.output;
      EXPECT_FALSE(has(r, "driver version is insufficient")) << r.output;
    }
  } else {
    EXPECT_EQ(r.status, 0) << r.output;
    EXPECT_TRUE(has(r, "device buffers:")) << r.output;
    EXPECT_FALSE(has(r, " NO")) << r.output;
  }
  // mxfp8 has no Hopper kernels: refused by name on any machine (fp8 and fp8_bwd run on a GPU).
  const Result mx = run_cli("run --preset tiny --tokens 16 --backend cuda --precision mxfp8");
  EXPECT_EQ(mx.status, 2) << mx.output;
  if (access("/proc/driver/nvidia/version", F_OK) == 0) {
    EXPECT_TRUE(has(mx, "Blackwell")) << mx.output;
  }
}

}  // namespace
