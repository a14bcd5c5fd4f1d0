// Value types of the public API: enum names, parsing, views, status text, FLOP counts.
#include <gtest/gtest.h>

#include "megamoe/moe.h"

namespace megamoe {
namespace {

TEST(Types, PrecisionNamesRoundTrip) {
  for (Precision p : {Precision::kBF16, Precision::kFP8, Precision::kFP8Bwd, Precision::kMXFP8}) {
    Precision back = Precision::kBF16;
    ASSERT_TRUE(parse_precision(to_string(p), &back).ok());
    EXPECT_EQ(back, p);
  }
  EXPECT_STREQ(to_string(Precision::kFP8Bwd), "fp8_bwd");
}

TEST(Types, UnknownEnumValuesListTheChoices) {
  Precision p;
  const Status st = parse_precision("fp16", &p);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("'fp16'"), std::string::npos);
  EXPECT_NE(st.message().find("bf16 | fp8 | fp8_bwd | mxfp8"), std::string::npos);
  Backend b;
  EXPECT_FALSE(parse_backend("gpu", &b).ok());
  SavePolicy s;
  EXPECT_FALSE(parse_save_policy("none", &s).ok());
  ScaleMode m;
  EXPECT_TRUE(parse_scale_mode("pow2", &m).ok());
  EXPECT_EQ(m, ScaleMode::kPowerOfTwo);
}

TEST(Types, ViewShapeAndSize) {
  int32_t buf[24];
  const TensorView v = make_view(buf, DType::kI32, {2, 3, 4});
  EXPECT_EQ(v.rank, 3);
  EXPECT_EQ(v.numel(), 24);
  EXPECT_EQ(v.size_bytes(), 96);
  EXPECT_EQ(v.shape_string(), "[2, 3, 4]");
  EXPECT_EQ(dtype_size(DType::kBF16), 2);
  EXPECT_EQ(dtype_size(DType::kFP8E4M3), 1);
}

TEST(Types, TooManyDimsMakeAnInvalidView) {
  float buf[120];
  const TensorView v = make_view(buf, DType::kF32, {1, 2, 3, 4, 5});
  EXPECT_EQ(v.rank, -1);
  EXPECT_EQ(v.shape_string(), "[rank > 4]");
}

TEST(Types, StatusText) {
  EXPECT_EQ(Status::Ok().to_string(), "OK");
  EXPECT_EQ(invalid_argument("x: bad").to_string(), "InvalidArgument: x: bad");
  EXPECT_EQ(capacity_error("too many").code(), StatusCode::kCapacity);
  EXPECT_FALSE(unavailable("no gpu").ok());
}

TEST(Types, FlopCountsFollowTheDesign) {
  MoeProblem p;
  p.num_tokens = 16384;
  p.hidden = 2048;
  p.intermediate = 768;
  p.top_k = 8;
  const double base = 16384.0 * 8 * 2048 * 768;
  EXPECT_DOUBLE_EQ(forward_flops(p), 6 * base);
  EXPECT_DOUBLE_EQ(backward_flops(p, SavePolicy::kKeep), 12 * base);
  EXPECT_DOUBLE_EQ(backward_flops(p, SavePolicy::kRecompute), 16 * base);
}

}  // namespace
}  // namespace megamoe
