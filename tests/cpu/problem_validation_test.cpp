// validate_problem: every shape-level rule gives a clear error naming the value.
#include <gtest/gtest.h>

#include "megamoe/problem.h"

namespace megamoe {
namespace {

MoeProblem good() {
  MoeProblem p;
  p.num_tokens = 100;
  p.hidden = 256;
  p.intermediate = 128;
  p.num_experts = 8;
  p.top_k = 2;
  p.ep_size = 2;
  p.ep_rank = 1;
  p.max_tokens_per_rank = 128;
  return p;
}

void expect_error(const MoeProblem& p, StatusCode code, const std::string& fragment) {
  const Status st = validate_problem(p);
  EXPECT_EQ(st.code(), code) << st.to_string();
  EXPECT_NE(st.message().find(fragment), std::string::npos) << "message: " << st.message();
}

TEST(ProblemValidation, AcceptsAGoodProblem) { EXPECT_TRUE(validate_problem(good()).ok()); }

TEST(ProblemValidation, HiddenNotMultipleOf128) {
  MoeProblem p = good();
  p.hidden = 1000;
  expect_error(p, StatusCode::kInvalidArgument, "hidden = 1000 must be a positive multiple of 128");
}

TEST(ProblemValidation, IntermediateNotMultipleOf128) {
  MoeProblem p = good();
  p.intermediate = 96;
  expect_error(p, StatusCode::kInvalidArgument, "intermediate = 96");
}

TEST(ProblemValidation, ExpertsNotDivisibleByRanks) {
  MoeProblem p = good();
  p.num_experts = 6;
  p.ep_size = 4;
  p.ep_rank = 0;
  expect_error(p, StatusCode::kInvalidArgument, "num_experts = 6 is not divisible by ep_size = 4");
}

TEST(ProblemValidation, TokensAboveMaximum) {
  MoeProblem p = good();
  p.num_tokens = 129;
  expect_error(p, StatusCode::kCapacity, "num_tokens = 129 exceeds max_tokens_per_rank = 128");
}

TEST(ProblemValidation, TopKOutOfRange) {
  MoeProblem p = good();
  p.top_k = 0;
  expect_error(p, StatusCode::kInvalidArgument, "top_k = 0");
  p.top_k = 9;
  expect_error(p, StatusCode::kInvalidArgument, "top_k = 9 must be in [1, num_experts = 8]");
}

TEST(ProblemValidation, RankOutOfRange) {
  MoeProblem p = good();
  p.ep_rank = 2;
  expect_error(p, StatusCode::kInvalidArgument, "ep_rank = 2 is out of range");
  p.ep_size = 0;
  expect_error(p, StatusCode::kInvalidArgument, "ep_size = 0");
}

TEST(ProblemValidation, NegativeCounts) {
  MoeProblem p = good();
  p.num_tokens = -1;
  expect_error(p, StatusCode::kInvalidArgument, "num_tokens = -1 is negative");
  p = good();
  p.num_experts = 0;
  expect_error(p, StatusCode::kInvalidArgument, "num_experts = 0");
}

TEST(ProblemValidation, ZeroMaxTokensMeansNumTokens) {
  MoeProblem p = good();
  p.max_tokens_per_rank = 0;
  EXPECT_TRUE(validate_problem(p).ok());
  EXPECT_EQ(p.token_capacity(), 100);
}

TEST(ProblemValidation, RoutedRowsMustFitInt32Indices) {
  MoeProblem p = good();
  p.max_tokens_per_rank = int64_t{1} << 28;
  p.num_tokens = 1;
  p.top_k = 8;
  expect_error(p, StatusCode::kInvalidArgument, "exceeds 2^30 routed rows");
}

}  // namespace
}  // namespace megamoe
