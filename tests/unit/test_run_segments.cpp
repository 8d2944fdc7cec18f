// model::run_segments (model/batch.h): the GPU indexer's calls over a batch, each a stretch of
// consecutive sequences whose runs of new tokens are all long (prefill chunks) or all short (decode
// tokens), so that a served prefill chunk and the decode tokens beside it take different kernels.
#include <gtest/gtest.h>

#include <vector>

#include "model/batch.h"

namespace sparsemla::model {
namespace {

std::vector<SeqInput> batch_of(const std::vector<int>& sizes) {
  std::vector<SeqInput> b;
  for (int n : sizes) {
    SeqInput in;
    in.tokens.assign(size_t(n), 1);
    b.push_back(in);
  }
  return b;
}

struct Seg {
  int64_t begin, end, per_run;
};
void expect_segments(const std::vector<int>& sizes, const std::vector<Seg>& want) {
  const std::vector<RunSegment> got = run_segments(batch_of(sizes), 8);
  ASSERT_EQ(got.size(), want.size()) << "segments of a batch of " << sizes.size() << " sequences";
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].begin, want[i].begin) << "segment " << i;
    EXPECT_EQ(got[i].end, want[i].end) << "segment " << i;
    EXPECT_EQ(got[i].tokens_per_run, want[i].per_run) << "segment " << i;
  }
}

TEST(RunSegments, DecodeTokensAndPrefillChunksGoApart) {
  expect_segments({}, {});
  expect_segments({1, 1, 1, 1}, {{0, 4, 1}});                 // a decode step: one call, as before
  expect_segments({4096}, {{0, 4096, 4096}});                 // one prefill chunk
  expect_segments({1, 1, 1, 4000}, {{0, 3, 1}, {3, 4003, 4000}});  // decode tokens, then a chunk
  expect_segments({4000, 1, 1}, {{0, 4000, 4000}, {4000, 4002, 1}});
  expect_segments({100, 20, 1, 7, 9}, {{0, 120, 60}, {120, 128, 4}, {128, 137, 9}});
  expect_segments({8, 7}, {{0, 8, 8}, {8, 15, 7}});  // the threshold: 8 is a long run, 7 a short one
}

}  // namespace
}  // namespace sparsemla::model
