// Tensor parallelism on the CPU: the in-process communicator, column slices of quantized weights,
// the sharding plan and its bind-time check, and the sharded forward against the unsharded forward
// and the fixtures' transformers logits.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <stdexcept>
#include <thread>

#include "dist/communicator.h"
#include "dist/rank_threads.h"
#include "dist/shard_plan.h"
#include "dist/shard_weights.h"
#include "dist/sharded_model.h"
#include "gguf/ggml_types.h"
#include "gguf/reader.h"
#include "gguf/writer.h"
#include "model/model.h"
#include "model/synthetic.h"
#include "ops/cpu/matmul.h"
#include "legacy_kv_b.h"
#include "test_util.h"
#include "util/error.h"

namespace sparsemla::dist {
namespace {

using model::AttentionMode;
using model::HParams;
using model::SeqInput;

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Runs fn on the group's ranks; a group that hangs fails the test within a minute (and ends the
// process, whose threads cannot be joined) instead of waiting for ctest's timeout.
std::string run_group(InProcessGroup& g, const std::function<void(Communicator&)>& fn,
                      RankThreads* threads = nullptr) {
  auto done = std::async(std::launch::async, [&] { return test::error_of([&] { g.run(fn, threads); }); });
  if (done.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    std::fprintf(stderr, "the process group hung: a collective was never released\n");
    std::_Exit(1);
  }
  return done.get();
}

// ---------------------------------------------------------------------------------------------
// Communicator

// Values of very different magnitudes, so that a different summation order gives different bits.
float value(int rank, int64_t i, int round) {
  const float scale = (rank + i + round) % 3 == 0 ? 1e7f : ((rank + i) % 3 == 1 ? 1.0f : 1e-3f);
  return scale * std::sin(float(rank * 7919 + i * 31 + round * 17 + 1));
}

TEST(Communicator, AllReduceSumsInRankOrderWithTheSameBitsOnEveryRank) {
  for (int N : {1, 2, 3, 4, 8}) {
    InProcessGroup g(N);
    const std::vector<int64_t> sizes = {1, 17, 1000, 0, 4096, 3};
    std::vector<std::vector<std::vector<float>>> got(static_cast<size_t>(N));  // [rank][round] -> result
    const std::string err = run_group(g, [&](Communicator& c) {
      EXPECT_EQ(c.size(), N);
      for (size_t round = 0; round < sizes.size(); ++round) {
        std::vector<float> v(static_cast<size_t>(sizes[round]));
        for (int64_t i = 0; i < sizes[round]; ++i) v[size_t(i)] = value(c.rank(), i, int(round));
        c.all_reduce_sum(v.data(), sizes[round]);
        got[size_t(c.rank())].push_back(std::move(v));
      }
    });
    ASSERT_EQ(err, "(no error)") << N << " ranks";
    for (size_t round = 0; round < sizes.size(); ++round)
      for (int64_t i = 0; i < sizes[round]; ++i) {
        float want = value(0, i, int(round));  // serial, in rank order
        for (int r = 1; r < N; ++r) want += value(r, i, int(round));
        for (int r = 0; r < N; ++r)
          ASSERT_EQ(std::memcmp(&got[size_t(r)][round][size_t(i)], &want, sizeof(float)), 0)
              << N << " ranks, round " << round << ", rank " << r << ", i " << i << ": " << got[size_t(r)][round][size_t(i)]
              << " vs " << want;
      }
  }
}

TEST(Communicator, AllGatherConcatenatesInRankOrderAndBroadcastCopiesTheRoot) {
  for (int N : {1, 2, 3, 4, 8}) {
    InProcessGroup g(N);
    const int64_t n = 37;
    const std::string err = run_group(g, [&](Communicator& c) {
      std::vector<float> in(static_cast<size_t>(n)), out(static_cast<size_t>(N * n), -1.0f);
      for (int64_t i = 0; i < n; ++i) in[size_t(i)] = float(c.rank() * 1000 + i);
      c.all_gather(in.data(), n, out.data());
      for (int r = 0; r < N; ++r)
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(out[size_t(r * n + i)], float(r * 1000 + i)) << N << " ranks";
      // In place: each rank's input already in its own slot of the output.
      std::vector<float> inplace(size_t(N * n), -1.0f);
      std::copy(in.begin(), in.end(), inplace.begin() + c.rank() * n);
      c.all_gather(inplace.data() + c.rank() * n, n, inplace.data());
      EXPECT_EQ(inplace, out);
      for (int root = 0; root < N; ++root) {
        std::vector<float> b(5, float(c.rank()));
        c.broadcast(b.data(), 5, root);
        EXPECT_EQ(b, std::vector<float>(5, float(root)));
      }
      c.barrier();
    });
    ASSERT_EQ(err, "(no error)") << N << " ranks";
  }
}

// Each rank's fate in a failing group: the message of the Error it got, or "(no error)".
struct Fates {
  explicit Fates(int n) : what(size_t(n), "(no error)") {}
  void record(int rank, const std::function<void()>& fn) {
    try {
      fn();
    } catch (const Error& e) {
      what[size_t(rank)] = e.what();
      throw;
    }
  }
  std::vector<std::string> what;
};

// On threads started for the call, and on long-lived rank threads (which then serve a fresh group).
TEST(Communicator, ARankThatThrowsReleasesTheOthersWithAnError) {
  RankThreads pool(4);
  for (RankThreads* threads : {static_cast<RankThreads*>(nullptr), &pool})
    for (int when : {0, 3}) {  // before the first collective, and after three
      InProcessGroup g(4);
      Fates fates(4);
      const std::string err = run_group(
          g,
          [&](Communicator& c) {
            fates.record(c.rank(), [&] {
              std::vector<float> v(8, 1.0f);
              for (int i = 0; i < 10; ++i) {
                if (c.rank() == 2 && i == when) throw std::runtime_error("out of memory on rank two");
                c.all_reduce_sum(v.data(), 8);
              }
            });
          },
          threads);
      EXPECT_TRUE(contains(err, "rank 2 failed: out of memory on rank two")) << err;
      for (int r : {0, 1, 3}) {
        EXPECT_TRUE(contains(fates.what[size_t(r)], "all_reduce_sum abandoned")) << fates.what[size_t(r)];
        EXPECT_TRUE(contains(fates.what[size_t(r)], "rank 2 failed: out of memory on rank two")) << fates.what[size_t(r)];
      }
      // The group stays failed; a new group on the same threads works.
      EXPECT_TRUE(contains(run_group(g, [](Communicator& c) { c.barrier(); }, threads), "rank 2 failed"))
          << "after a failure";
      InProcessGroup fresh(4);
      std::vector<float> sums(4, 0.0f);
      EXPECT_EQ(run_group(
                    fresh,
                    [&](Communicator& c) {
                      float v = float(c.rank() + 1);
                      c.all_reduce_sum(&v, 1);
                      sums[size_t(c.rank())] = v;
                    },
                    threads),
                "(no error)");
      EXPECT_EQ(sums, std::vector<float>(4, 10.0f));
    }
  RankThreads three(3);
  InProcessGroup g(4);
  EXPECT_TRUE(contains(run_group(g, [](Communicator&) {}, &three), "3 rank threads for a group of 4"));
}

TEST(Communicator, MismatchedSizesAreAnErrorOnEveryRank) {
  InProcessGroup g(3);
  Fates fates(3);
  const std::string err = run_group(g, [&](Communicator& c) {
    fates.record(c.rank(), [&] {
      std::vector<float> v(8, 1.0f);
      c.all_reduce_sum(v.data(), c.rank() == 1 ? 5 : 4);
    });
  });
  EXPECT_EQ(err, "all_reduce_sum: the ranks disagree on the size: values by rank 4, 5, 4");
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(contains(fates.what[size_t(r)], "values by rank 4, 5, 4")) << r << ": " << fates.what[size_t(r)];

  InProcessGroup g2(2);
  const std::string err2 = run_group(g2, [&](Communicator& c) {
    std::vector<float> v(8, 1.0f), out(16);
    if (c.rank() == 0) c.all_reduce_sum(v.data(), 8);
    else c.all_gather(v.data(), 8, out.data());
  });
  EXPECT_EQ(err2, "collective mismatch: rank 0 called all_reduce_sum, rank 1 called all_gather");

  InProcessGroup g3(2);
  const std::string err3 = run_group(g3, [&](Communicator& c) {
    std::vector<float> v(4);
    c.broadcast(v.data(), 4, c.rank());
  });
  EXPECT_TRUE(contains(err3, "broadcast: the ranks disagree")) << err3;
}

TEST(Communicator, ARankThatReturnsEarlyIsAnErrorNotAHang) {
  InProcessGroup g(3);
  const std::string err = run_group(g, [&](Communicator& c) {
    std::vector<float> v(4, 1.0f);
    if (c.rank() != 1) c.all_reduce_sum(v.data(), 4);
  });
  EXPECT_TRUE(contains(err, "rank 1")) << err;
  EXPECT_TRUE(contains(err, "left the group")) << err;
}

// ---------------------------------------------------------------------------------------------
// Column slices of quantized weights: what attn_output and ffn_down shards are.

class ShardColumnSlice : public ::testing::TestWithParam<std::string> {};

TEST_P(ShardColumnSlice, EqualsTheProductOnACopyOfThoseColumnsAndTheSlicesSumToTheWhole) {
  const auto type = gguf::type_from_name(GetParam());
  ASSERT_TRUE(type.has_value());
  const std::vector<uint8_t> blocks = test::read_values<uint8_t>(test::data_path("quants/dequant_" + GetParam() + ".bin"));
  ASSERT_FALSE(blocks.empty());
  const auto& tr = gguf::traits(*type);
  // Rows of 4 blocks (64 values for the plain types); the slices are blocks [0,1), [1,3), [3,4).
  const int64_t unit = tr.block_size == 1 ? 16 : int64_t(tr.block_size);
  const uint64_t unit_bytes = tr.block_size == 1 ? 16 * tr.type_size : tr.type_size;
  ops::Weight w;
  w.type = *type;
  w.n_cols = 4 * unit;
  w.row_bytes = 4 * unit_bytes;
  w.n_rows = int64_t(blocks.size() / w.row_bytes);
  w.data = blocks.data();
  ASSERT_GE(w.n_rows, 2);
  ops::ThreadPool pool(2);
  const int64_t T = 3;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  std::vector<float> x(size_t(T * w.n_cols));
  for (float& v : x) v = nd(rng);

  std::vector<float> full(size_t(T * w.n_rows)), sum(size_t(T * w.n_rows), 0.0f);
  ops::matmul(w, x.data(), T, full.data(), pool);
  for (auto [b0, b1] : {std::pair<int64_t, int64_t>{0, 1}, {1, 3}, {3, 4}}) {
    const ops::Weight s = w.cols(b0 * unit, (b1 - b0) * unit);
    EXPECT_EQ(s.contiguous(), b1 - b0 == 4);
    // The same blocks copied into a contiguous matrix of their own.
    std::vector<uint8_t> copy;
    for (int64_t r = 0; r < w.n_rows; ++r)
      copy.insert(copy.end(), w.row(r) + b0 * unit_bytes, w.row(r) + b1 * unit_bytes);
    ops::Weight c = s;
    c.row_bytes = uint64_t(b1 - b0) * unit_bytes;
    c.data = copy.data();
    ASSERT_TRUE(c.contiguous());
    std::vector<float> xs(size_t(T * s.n_cols));
    for (int64_t t = 0; t < T; ++t) std::copy_n(x.data() + t * w.n_cols + b0 * unit, s.n_cols, xs.data() + t * s.n_cols);
    std::vector<float> ys(size_t(T * w.n_rows)), yc(size_t(T * w.n_rows));
    ops::matmul(s, xs.data(), T, ys.data(), pool);
    ops::matmul(c, xs.data(), T, yc.data(), pool);
    for (size_t i = 0; i < ys.size(); ++i) {
      EXPECT_TRUE(ys[i] == yc[i] || (std::isnan(ys[i]) && std::isnan(yc[i]))) << GetParam() << " blocks [" << b0 << ", " << b1 << ") " << i;
      sum[i] += ys[i];
    }
    std::vector<float> row_s(size_t(s.n_cols)), row_w(size_t(w.n_cols));
    ops::dequantize_row(s, 1, row_s.data());
    ops::dequantize_row(w, 1, row_w.data());
    for (int64_t k = 0; k < s.n_cols; ++k) {
      const float a = row_s[size_t(k)], b = row_w[size_t(b0 * unit + k)];
      EXPECT_TRUE(a == b || (std::isnan(a) && std::isnan(b))) << GetParam() << " column " << b0 * unit + k;
    }
  }
  // Partial products add up to the whole one (up to the order of the sum).
  for (size_t i = 0; i < full.size(); ++i) {
    if (!std::isfinite(full[i]) || std::fabs(full[i]) > 1e30f) continue;
    EXPECT_NEAR(sum[i], full[i], 1e-5 * (std::fabs(full[i]) + 1.0)) << GetParam() << " " << i;
  }
  if (tr.block_size > 1)
    EXPECT_EQ(test::error_of([&] { w.cols(unit / 2, unit); }),
              fmt::format("weight columns [{}, {}) cut a {} block of {} values", unit / 2, unit + unit / 2, tr.name,
                          tr.block_size));
  EXPECT_EQ(test::error_of([&] { w.cols(unit, 4 * unit); }),
            fmt::format("weight columns [{}, {}) out of range (the weight has {} columns)", unit, 5 * unit, 4 * unit));
}

INSTANTIATE_TEST_SUITE_P(Types, ShardColumnSlice,
                         ::testing::Values("f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_K",
                                           "q3_K", "q4_K", "q5_K", "q6_K", "iq1_s", "iq1_m", "iq2_xxs", "iq2_xs",
                                           "iq2_s", "iq3_xxs", "iq3_s", "iq4_nl", "iq4_xs", "tq1_0", "tq2_0",
                                           "mxfp4"));

// ---------------------------------------------------------------------------------------------
// The plan

// GLM-5's and DeepSeek-V3.2's published shapes (MODEL_SPEC.md).
HParams glm5() {
  HParams hp;
  hp.arch = model::Arch::GlmDsa;
  hp.n_layer_total = 79, hp.n_nextn = 1, hp.n_layer = 78, hp.n_leading_dense = 3;
  hp.n_vocab = 154880, hp.n_embd = 6144, hp.n_ff = 12288;
  hp.n_head = 64, hp.q_lora_rank = 2048, hp.kv_lora_rank = 512, hp.qk_nope = 192, hp.qk_rope = 64, hp.v_head = 256;
  hp.n_expert = 256, hp.n_expert_used = 8, hp.n_expert_shared = 1, hp.n_ff_exp = 2048;
  hp.idx_heads = 32, hp.idx_dim = 128, hp.idx_top_k = 2048;
  hp.idx_full.assign(hp.n_layer_total, true);
  return hp;
}

HParams deepseek_v32() {
  HParams hp;
  hp.arch = model::Arch::DeepSeek32;
  hp.n_layer_total = 62, hp.n_nextn = 1, hp.n_layer = 61, hp.n_leading_dense = 3;
  hp.n_vocab = 129280, hp.n_embd = 7168, hp.n_ff = 18432;
  hp.n_head = 128, hp.q_lora_rank = 1536, hp.kv_lora_rank = 512, hp.qk_nope = 128, hp.qk_rope = 64, hp.v_head = 128;
  hp.n_expert = 256, hp.n_expert_used = 8, hp.n_expert_shared = 1, hp.n_ff_exp = 2048;
  hp.n_expert_groups = 8, hp.n_group_used = 4;
  hp.idx_heads = 64, hp.idx_dim = 128, hp.idx_top_k = 2048;
  hp.idx_full.assign(hp.n_layer_total, true);
  return hp;
}

// Types of a Q4_K_M-like file: matrices Q4_K, router and indexer projection F32.
std::optional<gguf::GgmlType> q4_k_file(const std::string& name) {
  if (contains(name, "gate_inp") || contains(name, "indexer.proj")) return gguf::GgmlType::F32;
  return gguf::GgmlType::Q4_K;
}

// Rank r's slice of `name` must be `want`, and the ranks' slices must tile the tensor.
void expect_slice(const ShardPlan& p, const std::string& name, int rank, Slice want) {
  const TensorSplit* t = p.find(name);
  ASSERT_NE(t, nullptr) << name;
  const Slice s = t->slice(rank);
  EXPECT_EQ(t->describe(s), t->describe(want)) << name << " rank " << rank << " of " << p.n_ranks();
}

void expect_tiling(const ShardPlan& p) {
  for (const TensorSplit& t : p.tensors()) {
    int64_t next = 0;
    for (int r = 0; r < p.n_ranks(); ++r) {
      const Slice s = t.slice(r);
      if (t.axis == SplitAxis::Replicated) {
        EXPECT_TRUE(s.row0 == 0 && s.n_rows == t.rows && s.col0 == 0 && s.n_cols == t.cols) << t.name;
        continue;
      }
      const int64_t first = t.axis == SplitAxis::Rows ? s.row0 : s.col0;
      const int64_t count = t.axis == SplitAxis::Rows ? s.n_rows : s.n_cols;
      EXPECT_EQ(first, next) << t.name << " rank " << r;
      EXPECT_GE(count, 0) << t.name;
      if (t.axis == SplitAxis::Cols) EXPECT_EQ(first % gguf::traits(t.type).block_size, 0) << t.name;
      next = first + count;
    }
    if (t.axis != SplitAxis::Replicated) EXPECT_EQ(next, t.axis == SplitAxis::Rows ? t.rows : t.cols) << t.name;
  }
}

TEST(ShardPlan, Glm5ShapesAtTwoFourAndEightRanks) {
  const HParams hp = glm5();
  for (int N : {2, 4, 8}) {
    for (const TensorTypes& types : {TensorTypes{}, TensorTypes{q4_k_file}}) {
      const ShardPlan p = ShardPlan::make(hp, N, types);
      EXPECT_EQ(p.heads_per_rank(), 64 / N);
      EXPECT_EQ(p.experts_per_rank(), 256 / N);
      EXPECT_EQ(p.vocab_per_rank(), 154880 / N);
      const int64_t h = 64 / N, e = 256 / N;
      for (int r = 0; r < N; ++r) {
        expect_slice(p, "token_embd.weight", r, {r * 154880 / N, 154880 / N, 0, 6144});
        expect_slice(p, "output.weight", r, {r * 154880 / N, 154880 / N, 0, 6144});
        expect_slice(p, "blk.3.attn_q_a.weight", r, {0, 2048, 0, 6144});
        expect_slice(p, "blk.3.attn_q_b.weight", r, {r * h * 256, h * 256, 0, 2048});
        expect_slice(p, "blk.3.attn_kv_a_mqa.weight", r, {0, 576, 0, 6144});
        expect_slice(p, "blk.3.attn_k_b.weight", r, {r * h * 512, h * 512, 0, 192});
        expect_slice(p, "blk.3.attn_v_b.weight", r, {r * h * 256, h * 256, 0, 512});
        expect_slice(p, "blk.3.attn_output.weight", r, {0, 6144, r * h * 256, h * 256});
        expect_slice(p, "blk.3.indexer.attn_q_b.weight", r, {0, 32 * 128, 0, 2048});
        expect_slice(p, "blk.3.indexer.attn_k.weight", r, {0, 128, 0, 6144});
        expect_slice(p, "blk.3.indexer.proj.weight", r, {0, 32, 0, 6144});
        expect_slice(p, "blk.0.ffn_gate.weight", r, {r * 12288 / N, 12288 / N, 0, 6144});
        expect_slice(p, "blk.0.ffn_up.weight", r, {r * 12288 / N, 12288 / N, 0, 6144});
        expect_slice(p, "blk.0.ffn_down.weight", r, {0, 6144, r * 12288 / N, 12288 / N});
        expect_slice(p, "blk.77.ffn_gate_inp.weight", r, {0, 256, 0, 6144});
        expect_slice(p, "blk.77.ffn_gate_exps.weight", r, {r * e * 2048, e * 2048, 0, 6144});
        expect_slice(p, "blk.77.ffn_up_exps.weight", r, {r * e * 2048, e * 2048, 0, 6144});
        expect_slice(p, "blk.77.ffn_down_exps.weight", r, {r * e * 6144, e * 6144, 0, 2048});
        expect_slice(p, "blk.77.ffn_gate_shexp.weight", r, {r * 2048 / N, 2048 / N, 0, 6144});
        expect_slice(p, "blk.77.ffn_down_shexp.weight", r, {0, 6144, r * 2048 / N, 2048 / N});
      }
      EXPECT_EQ(p.find("blk.3.ffn_gate.weight"), nullptr) << "layer 3 is MoE";
      EXPECT_EQ(p.find("blk.78.attn_q_b.weight"), nullptr) << "the next-n layer is not run";
      expect_tiling(p);
      EXPECT_TRUE(contains(p.summary(), fmt::format("per rank {} attention heads, {} routed experts", h, e))) << p.summary();
    }
  }
  // The message for a head: rows of attn_k_b are heads of kv_lora rows each.
  const ShardPlan p = ShardPlan::make(hp, 8);
  EXPECT_EQ(p.find("blk.5.attn_k_b.weight")->describe(p.find("blk.5.attn_k_b.weight")->slice(3)),
            "4096 x 192: rows [12288, 16384) x columns [0, 192) (heads 24..31)");
}

TEST(ShardPlan, DeepSeekV32ShapesAtTwoFourAndEightRanks) {
  const HParams hp = deepseek_v32();
  for (int N : {2, 4, 8}) {
    const ShardPlan p = ShardPlan::make(hp, N, q4_k_file);
    const int64_t h = 128 / N, e = 256 / N;
    for (int r = 0; r < N; ++r) {
      expect_slice(p, "blk.10.attn_q_b.weight", r, {r * h * 192, h * 192, 0, 1536});
      expect_slice(p, "blk.10.attn_k_b.weight", r, {r * h * 512, h * 512, 0, 128});
      expect_slice(p, "blk.10.attn_v_b.weight", r, {r * h * 128, h * 128, 0, 512});
      expect_slice(p, "blk.10.attn_output.weight", r, {0, 7168, r * h * 128, h * 128});
      expect_slice(p, "blk.1.ffn_down.weight", r, {0, 7168, r * 18432 / N, 18432 / N});
      expect_slice(p, "blk.10.ffn_down_exps.weight", r, {r * e * 7168, e * 7168, 0, 2048});
      expect_slice(p, "output.weight", r, {r * 129280 / N, 129280 / N, 0, 7168});
    }
    expect_tiling(p);
  }
}

TEST(ShardPlan, RefusesWhatDoesNotDivide) {
  const HParams glm = glm5();
  EXPECT_EQ(test::error_of([&] { ShardPlan::make(glm, 3); }),
            "tensor parallel over 3 ranks: the model's 64 attention heads do not divide by 3");
  EXPECT_EQ(test::error_of([&] { ShardPlan::make(glm, 128); }),
            "tensor parallel over 128 ranks: the model's 64 attention heads do not divide by 128");
  EXPECT_EQ(test::error_of([&] { ShardPlan::make(glm, 0); }), "tensor parallel: 0 ranks; give 1 or more");
  HParams experts = glm;
  experts.n_expert = 160;
  EXPECT_EQ(test::error_of([&] { ShardPlan::make(experts, 64); }),
            "tensor parallel over 64 ranks: the model's 160 routed experts do not divide by 64");
  HParams vocab = glm;
  vocab.n_vocab = 154881;
  EXPECT_EQ(test::error_of([&] { ShardPlan::make(vocab, 2); }),
            "tensor parallel over 2 ranks: the vocabulary of 154881 tokens does not divide by 2");
  // attn_output's column split is fixed by the heads: one DeepSeek head of 128 values per rank
  // cuts a Q4_K block of 256 in two.
  EXPECT_EQ(test::error_of([&] { ShardPlan::make(deepseek_v32(), 128, q4_k_file); }),
            "tensor parallel over 128 ranks: blk.0.attn_output.weight is q4_K (blocks of 256 values) and each rank's "
            "1 heads x 128 values = 128 of its input columns, which is not a whole number of blocks");
  EXPECT_EQ(test::error_of([&] { ShardPlan::make(deepseek_v32(), 128); }), "(no error)") << "F32 has no blocks to cut";
}

// An FFN whose width is not a whole number of blocks per rank is cut in whole blocks (exact; some
// ranks then hold none of it) rather than refused: GLM-5's 2048-wide shared expert at 16 ranks.
TEST(ShardPlan, FfnColumnSplitsFallOnBlockBoundaries) {
  const ShardPlan p = ShardPlan::make(glm5(), 16, q4_k_file);
  const TensorSplit* down = p.find("blk.3.ffn_down_shexp.weight");
  ASSERT_NE(down, nullptr);
  std::vector<int64_t> want;
  for (int r = 0; r <= 16; ++r) want.push_back(8 * r / 16 * 256);  // 8 blocks of 256 over 16 ranks
  EXPECT_EQ(down->bounds, want);
  EXPECT_EQ(p.find("blk.3.ffn_gate_shexp.weight")->bounds, want);
  EXPECT_EQ(p.find("blk.3.ffn_up_shexp.weight")->bounds, want);
  expect_tiling(p);
  EXPECT_TRUE(contains(p.summary(), "shared expert 0/256/0/256/0/256/0/256/0/256/0/256/0/256/0/256 columns")) << p.summary();
}

// ---------------------------------------------------------------------------------------------
// The bind-time check: a shard that is not the plan's slice is refused, naming tensor and rank.

std::string fixture_model(const std::string& name) { return test::fixture_model_path(name); }

TEST(ShardBind, AShardOfTheWrongHeadOrShapeIsCaughtWithAClearMessage) {
  auto m = model::Model::load(fixture_model("glm_share_q8_0"), {AttentionMode::Sparse, 1});
  const HParams& hp = m->hparams();  // 4 heads, kv_lora 32, nope 16, v_head 32
  const model::ModelWeights& full = m->weights();
  const ShardPlan plan = ShardPlan::make(hp, 2, types_of(m->file()));
  const model::ModelWeights good = bind_shard(full, hp, plan, 1);
  EXPECT_EQ(test::error_of([&] { verify_shard(full, good, hp, plan, 1); }), "(no error)");

  model::ModelWeights bad = good;  // rank 1's k_b rows taken from heads 0..1 instead of 2..3
  bad.layers[1].mla.k_b = full.layers[1].mla.k_b.rows(0, 64);
  EXPECT_EQ(test::error_of([&] { verify_shard(full, bad, hp, plan, 1); }),
            "tensor-parallel shard check: blk.1.attn_k_b.weight on rank 1 of 2: expected 64 x 16: rows [64, 128) x "
            "columns [0, 16) (heads 2..3), found 64 x 16: rows [0, 64) x columns [0, 16) (heads 0..1)");

  bad = good;  // one head too few
  bad.layers[2].mla.v_b = full.layers[2].mla.v_b.rows(64, 32);
  EXPECT_EQ(test::error_of([&] { verify_shard(full, bad, hp, plan, 1); }),
            "tensor-parallel shard check: blk.2.attn_v_b.weight on rank 1 of 2: expected 64 x 32: rows [64, 128) x "
            "columns [0, 32) (heads 2..3), found 32 x 32: rows [64, 96) x columns [0, 32) (head 2)");

  bad = good;  // attn_output columns of rank 0's heads
  bad.layers[0].mla.output = full.layers[0].mla.output.cols(0, 64);
  EXPECT_EQ(test::error_of([&] { verify_shard(full, bad, hp, plan, 1); }),
            "tensor-parallel shard check: blk.0.attn_output.weight on rank 1 of 2: expected 128 x 64: rows [0, 128) x "
            "columns [64, 128) (heads 2..3), found 128 x 64: rows [0, 128) x columns [0, 64) (heads 0..1)");

  bad = good;  // another layer's tensor altogether
  bad.layers[1].mla.k_b = full.layers[2].mla.k_b.rows(64, 64);
  EXPECT_EQ(test::error_of([&] { verify_shard(full, bad, hp, plan, 1); }),
            "tensor-parallel shard check: blk.1.attn_k_b.weight on rank 1 of 2: expected 64 x 16: rows [64, 128) x "
            "columns [0, 16) (heads 2..3), found a view that is not a slice of it");

  bad = good;  // experts of rank 0
  bad.layers[1].ffn.down_exps = full.layers[1].ffn.down_exps.rows(0, 4 * 128);
  EXPECT_TRUE(contains(test::error_of([&] { verify_shard(full, bad, hp, plan, 1); }),
                       "blk.1.ffn_down_exps.weight on rank 1 of 2: expected 512 x 64: rows [512, 1024) x columns [0, 64) "
                       "(experts 4..7), found 512 x 64: rows [0, 512) x columns [0, 64) (experts 0..3)"));

  // A plan for another model is refused at bind, naming the tensor.
  const ShardPlan other = ShardPlan::make(hp, 2);  // every tensor taken as F32
  EXPECT_TRUE(contains(test::error_of([&] { bind_shard(full, hp, other, 0); }), "the plan has token_embd.weight as f32"))
      << test::error_of([&] { bind_shard(full, hp, other, 0); });
}

// ---------------------------------------------------------------------------------------------
// The sharded forward against the unsharded one and the fixtures' transformers logits.

// Tolerance against the unsharded forward, relative to the largest logit. Sharding changes only
// the order of the sums across ranks (attention and FFN outputs, and embeddings plus exact zeros):
// a few fp32 ulps (~1e-7 relative) per layer, carried through a handful of layers. 1e-5 leaves
// room for that and nothing more; a sharding mistake (a wrong head, a missing expert) is O(1).
constexpr double kShardTol = 1e-5;

// max |got - ref| / max |ref| over all rows; also checks finiteness and the argmax of every row.
double rel_diff(const std::vector<float>& got, const std::vector<float>& ref, int64_t vocab, const std::string& what) {
  EXPECT_EQ(got.size(), ref.size()) << what;
  if (got.size() != ref.size() || ref.empty()) return INFINITY;
  double max_ref = 0, max_diff = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_TRUE(std::isfinite(got[i])) << what << ": logit " << i;
    max_ref = std::max(max_ref, std::fabs(double(ref[i])));
    max_diff = std::max(max_diff, std::fabs(double(got[i]) - ref[i]));
  }
  for (size_t r = 0; r < ref.size() / size_t(vocab); ++r)
    EXPECT_EQ(test::argmax(got.data() + r * vocab, vocab), test::argmax(ref.data() + r * vocab, vocab)) << what << " row " << r;
  return max_diff / max_ref;
}

// The largest difference per fixture and rank count, printed at the end of the suite.
std::map<std::string, double>& measured() {
  static std::map<std::string, double> m;
  return m;
}
void note(const std::string& key, double d) { measured()[key] = std::max(measured()[key], d); }

// Both forwards on one model, each with its own cache.
struct Pair {
  Pair(const std::string& path, int n_ranks, AttentionMode mode)
      : m(model::Model::load(path, {mode, 1})), tp(*m, n_ranks, n_ranks), cache(m->cache_shape(64, 4)),
        replicas(tp.make_cache(64, 4)) {}
  std::vector<float> whole(const std::vector<SeqInput>& batch) {
    std::vector<float> l;
    m->forward(batch, cache, l);
    return l;
  }
  std::vector<float> sharded(const std::vector<SeqInput>& batch) {
    std::vector<float> l;
    tp.forward(batch, replicas, l);
    return l;
  }
  std::unique_ptr<model::Model> m;
  ShardedModel tp;
  kv::PagedCache cache;
  ReplicatedCache replicas;
};

class TensorParallelFixture : public ::testing::TestWithParam<std::tuple<std::string, int>> {
 protected:
  std::string name() const { return std::get<0>(GetParam()); }
  int ranks() const { return std::get<1>(GetParam()); }
  std::string dir() const { return test::fixture_path(name()); }
  std::string key() const { return fmt::format("{} N={}", name(), ranks()); }
  // The reason this fixture cannot be split over ranks() ranks, or "" (then the plan must work).
  std::string why_not() const {
    auto f = gguf::File::open(fixture_model(name()));
    const HParams hp = model::load_hparams(*f);
    if (hp.n_head % ranks() != 0)
      return fmt::format("{}: its {} attention heads do not divide by {} ranks (the plan refuses it, see "
                         "ShardPlan.RefusesWhatDoesNotDivide); covered at 8 ranks by TensorParallelSynthetic",
                         name(), hp.n_head, ranks());
    if (hp.n_expert % ranks() != 0)
      return fmt::format("{}: its {} experts do not divide by {} ranks", name(), hp.n_expert, ranks());
    return "";
  }
  void SetUp() override {
    if (const std::string why = why_not(); !why.empty()) GTEST_SKIP() << why;
  }
};

TEST_P(TensorParallelFixture, PromptLogitsMatchTheUnshardedForwardAndTransformers) {
  Pair p(fixture_model(name()), ranks(), AttentionMode::Sparse);
  const int64_t V = p.m->hparams().n_vocab;
  for (const char* seq : {"seq0", "seq1"}) {
    const auto ids = test::read_values<int32_t>(dir() + "/" + seq + ".tokens");
    ASSERT_GT(ids.size(), p.m->hparams().idx_top_k) << "the indexer must select";
    std::vector<int32_t> ta, tb;
    ASSERT_TRUE(p.cache.reserve(ta, int64_t(ids.size())));
    ASSERT_TRUE(p.replicas.reserve(tb, int64_t(ids.size())));
    const auto whole = p.whole({SeqInput{ids, 0, &ta, true}});
    const auto sharded = p.sharded({SeqInput{ids, 0, &tb, true}});
    const double d = rel_diff(sharded, whole, V, key() + " " + seq);
    EXPECT_LE(d, kShardTol) << key() << " " << seq;
    note(key(), d);
    const auto ref = test::read_values<float>(dir() + "/" + seq + ".logits.f32");
    EXPECT_LE(rel_diff(sharded, ref, V, key() + " " + seq + " vs transformers"), 1e-3);
    p.cache.release(ta);
    p.replicas.release(tb);
  }
}

TEST_P(TensorParallelFixture, GreedyDecodeThroughTheCacheMatchesTheUnshardedForward) {
  std::ifstream file(dir() + "/greedy.json");
  const auto j = nlohmann::json::parse(file);
  const std::vector<int32_t> prompt = j["prompt"], want = j["greedy"];
  Pair p(fixture_model(name()), ranks(), AttentionMode::Sparse);
  const int64_t V = p.m->hparams().n_vocab;
  std::vector<int32_t> ta, tb;
  ASSERT_TRUE(p.cache.reserve(ta, int64_t(prompt.size() + want.size())));
  ASSERT_TRUE(p.replicas.reserve(tb, int64_t(prompt.size() + want.size())));
  std::vector<int32_t> got;
  SeqInput a{prompt, 0, &ta, false}, b{prompt, 0, &tb, false};
  for (size_t i = 0; i < want.size(); ++i) {
    const auto whole = p.whole({a});
    const auto sharded = p.sharded({b});
    const double d = rel_diff(sharded, whole, V, fmt::format("{} step {}", key(), i));
    EXPECT_LE(d, kShardTol) << key() << " step " << i;
    note(key(), d);
    got.push_back(test::argmax(sharded.data(), V));
    a = SeqInput{{test::argmax(whole.data(), V)}, a.pos0 + int64_t(a.tokens.size()), &ta, false};
    b = SeqInput{{got.back()}, b.pos0 + int64_t(b.tokens.size()), &tb, false};
  }
  EXPECT_EQ(got, want) << key();
}

// Two sequences in one forward at different stages (prefill chunks, a decode token), every position.
TEST_P(TensorParallelFixture, BatchedChunkedForwardMatchesTheUnshardedForward) {
  Pair p(fixture_model(name()), ranks(), AttentionMode::Sparse);
  const int64_t V = p.m->hparams().n_vocab;
  const auto s0 = test::read_values<int32_t>(dir() + "/seq0.tokens");
  const auto s1 = test::read_values<int32_t>(dir() + "/seq1.tokens");
  std::vector<int32_t> a0, a1, b0, b1;  // a: the unsharded cache's tables, b: the replicas'
  ASSERT_TRUE(p.cache.reserve(a0, int64_t(s0.size())));
  ASSERT_TRUE(p.cache.reserve(a1, 21));
  ASSERT_TRUE(p.replicas.reserve(b0, int64_t(s0.size())));
  ASSERT_TRUE(p.replicas.reserve(b1, 21));
  auto steps = [&](const std::vector<int32_t>* t0, const std::vector<int32_t>* t1) {
    return std::vector<std::vector<SeqInput>>{
        {SeqInput{{s0.begin(), s0.begin() + 17}, 0, t0, true}, SeqInput{{s1.begin(), s1.begin() + 20}, 0, t1, true}},
        {SeqInput{{s0.begin() + 17, s0.begin() + 30}, 17, t0, true}, SeqInput{{s1[20]}, 20, t1, false}},
        {SeqInput{{s0.begin() + 30, s0.end()}, 30, t0, true}}};
  };
  const auto whole_steps = steps(&a0, &a1), sharded_steps = steps(&b0, &b1);
  for (size_t i = 0; i < whole_steps.size(); ++i) {
    const double d = rel_diff(p.sharded(sharded_steps[i]), p.whole(whole_steps[i]), V, fmt::format("{} batch step {}", key(), i));
    EXPECT_LE(d, kShardTol) << key() << " batch step " << i;
    note(key(), d);
  }
}

TEST_P(TensorParallelFixture, DenseModeMatchesTheUnshardedForward) {
  Pair p(fixture_model(name()), ranks(), AttentionMode::Dense);
  const auto ids = test::read_values<int32_t>(dir() + "/seq1.tokens");
  std::vector<int32_t> ta, tb;
  ASSERT_TRUE(p.cache.reserve(ta, int64_t(ids.size())));
  ASSERT_TRUE(p.replicas.reserve(tb, int64_t(ids.size())));
  const double d = rel_diff(p.sharded({SeqInput{ids, 0, &tb, true}}), p.whole({SeqInput{ids, 0, &ta, true}}),
                            p.m->hparams().n_vocab, key() + " dense");
  EXPECT_LE(d, kShardTol) << key() << " dense";
  note(key() + " dense", d);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TensorParallelFixture,
                         ::testing::Combine(::testing::Values("glm_pub", "dsv32_pub", "glm_share", "glm_share_q8_0",
                                                              "glm_q4_k", "dsv32_groups"),
                                            ::testing::Values(2, 4, 8)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" + std::to_string(std::get<1>(info.param)) + "ranks";
                         });

// One rank is the unsharded forward, bit for bit: same weights, same code, nothing to sum.
TEST(TensorParallel, OneRankIsTheUnshardedForwardBitForBit) {
  for (const char* name : {"glm_q4_k", "dsv32_groups"}) {
    Pair p(fixture_model(name), 1, AttentionMode::Sparse);
    const auto ids = test::read_values<int32_t>(test::fixture_path(std::string(name) + "/seq1.tokens"));
    std::vector<int32_t> ta, tb;
    ASSERT_TRUE(p.cache.reserve(ta, int64_t(ids.size())));
    ASSERT_TRUE(p.replicas.reserve(tb, int64_t(ids.size())));
    const auto whole = p.whole({SeqInput{ids, 0, &ta, true}});
    const auto sharded = p.sharded({SeqInput{ids, 0, &tb, true}});
    ASSERT_EQ(whole.size(), sharded.size());
    EXPECT_EQ(std::memcmp(whole.data(), sharded.data(), whole.size() * sizeof(float)), 0) << name;
  }
}

// A bad batch is refused before any rank starts, and the model stays usable.
TEST(TensorParallel, ABadBatchIsAnErrorAndTheModelStaysUsable) {
  Pair p(fixture_model("glm_share"), 2, AttentionMode::Sparse);
  std::vector<int32_t> t;
  ASSERT_TRUE(p.replicas.reserve(t, 4));
  std::vector<float> logits{1.0f};
  EXPECT_EQ(test::error_of([&] { p.tp.forward({SeqInput{{1, 5000}, 0, &t, true}}, p.replicas, logits); }),
            "forward: token id 5000 is outside the vocabulary of 1024 tokens");
  EXPECT_EQ(logits.size(), 1u);
  ReplicatedCache three = ReplicatedCache(p.m->cache_shape(4, 4), 3);
  EXPECT_EQ(test::error_of([&] { p.tp.forward({SeqInput{{1}, 0, &t, true}}, three, logits); }),
            "tensor parallel: a cache of 3 replicas for 2 ranks");
  EXPECT_EQ(p.sharded({SeqInput{{1, 2, 3, 4}, 0, &t, true}}).size(), 4u * 1024);
}

TEST(TensorParallel, LegacyFusedKvBIsSplitByHead) {
  test::TempDir dir("tp-kvb");
  test::write_legacy_kv_b(fixture_model("glm_share"), dir.file("legacy.gguf"));
  const auto ids = test::read_values<int32_t>(test::fixture_path("glm_share/seq1.tokens"));
  const auto ref = test::read_values<float>(test::fixture_path("glm_share/seq1.logits.f32"));
  for (int N : {2, 4}) {
    Pair p(dir.file("legacy.gguf"), N, AttentionMode::Sparse);
    ASSERT_TRUE(p.m->weights().layers[1].mla.legacy_kv_b);
    const TensorSplit* kvb = p.tp.plan().find("blk.1.attn_kv_b.weight");
    ASSERT_NE(kvb, nullptr);
    EXPECT_EQ(kvb->describe(kvb->slice(1)), N == 2 ? "96 x 32: rows [96, 192) x columns [0, 32) (heads 2..3)"
                                                   : "48 x 32: rows [48, 96) x columns [0, 32) (head 1)");
    std::vector<int32_t> ta, tb;
    ASSERT_TRUE(p.cache.reserve(ta, int64_t(ids.size())));
    ASSERT_TRUE(p.replicas.reserve(tb, int64_t(ids.size())));
    const auto sharded = p.sharded({SeqInput{ids, 0, &tb, true}});
    const std::string key = fmt::format("glm_share legacy kv_b N={}", N);
    const double d = rel_diff(sharded, p.whole({SeqInput{ids, 0, &ta, true}}), 1024, key);
    EXPECT_LE(d, kShardTol) << key;
    note(key, d);
    EXPECT_LE(rel_diff(sharded, ref, 1024, key + " vs transformers"), 1e-3);

    // kv_b rows of the wrong head are refused at bind.
    model::ModelWeights bad = bind_shard(p.m->weights(), p.m->hparams(), p.tp.plan(), 1);
    bad.layers[1].mla.kv_b = p.m->weights().layers[1].mla.kv_b.rows(0, kvb->slice(1).n_rows);
    EXPECT_TRUE(contains(test::error_of([&] { verify_shard(p.m->weights(), bad, p.m->hparams(), p.tp.plan(), 1); }),
                         "blk.1.attn_kv_b.weight on rank 1 of " + std::to_string(N) + ": expected " +
                             kvb->describe(kvb->slice(1)) + ", found"));
  }
}

// `sparsemla logits` and `sparsemla run` with --tensor-parallel, as a user runs them.
using test::CliResult;
CliResult cli(const std::string& args) { return test::run_cli(args); }

TEST(TensorParallelCli, LogitsAndRunGiveTheUnshardedResults) {
  test::TempDir dir("tp-cli");
  const std::string model = fixture_model("glm_share");
  const std::string tokens = test::fixture_path("glm_share/seq1.tokens");
  const CliResult whole = cli(fmt::format("logits -m {} --tokens {} -o {} -t 2", model, tokens, dir.file("whole.f32")));
  ASSERT_EQ(whole.status, 0) << whole.out;
  const CliResult tp = cli(fmt::format("logits -m {} --tokens {} -o {} -t 2 --tensor-parallel 4", model, tokens, dir.file("tp.f32")));
  ASSERT_EQ(tp.status, 0) << tp.out;
  EXPECT_TRUE(contains(tp.out, "tensor parallel over 4 ranks: per rank 1 attention heads, 2 routed experts, 256 vocabulary rows"))
      << tp.out;
  EXPECT_LE(rel_diff(test::read_values<float>(dir.file("tp.f32")), test::read_values<float>(dir.file("whole.f32")), 1024,
                     "cli logits"),
            kShardTol);

  const std::string run = fmt::format("run -m {} --tokens \"5 9 77 300 12\" -n 8 --json -t 2", model);
  const CliResult r1 = cli(run), r2 = cli(run + " --tensor-parallel 2");
  ASSERT_EQ(r1.status, 0) << r1.out;
  ASSERT_EQ(r2.status, 0) << r2.out;
  EXPECT_EQ(r1.out.substr(r1.out.find("{\"tokens\"")), r2.out.substr(r2.out.find("{\"tokens\"")));

  const CliResult refused = cli(run + " --tensor-parallel 8");
  EXPECT_EQ(refused.status, 1);
  EXPECT_TRUE(contains(refused.out, "error: tensor parallel over 8 ranks: the model's 4 attention heads do not divide by 8"))
      << refused.out;
  EXPECT_NE(cli(run + " --tensor-parallel 0").status, 0);
}

// No fixture has 8 heads; a synthetic GLM-5-shaped model (8 heads, 16 experts, Q8_0) covers 8 ranks,
// where its shared expert (2 blocks of Q8_0) lies on 2 of the 8 ranks.
TEST(TensorParallelSynthetic, TwoFourAndEightRanksMatchTheUnshardedForward) {
  test::TempDir dir("tp-synth");
  model::SyntheticSpec s;
  s.n_layer = 3;
  s.n_vocab = 512;
  s.n_embd = 128;
  s.n_ff = 256;
  s.n_head = 8;
  s.q_lora = 64, s.kv_lora = 64, s.qk_nope = 32, s.qk_rope = 16, s.v_head = 32;
  s.n_expert = 16, s.n_expert_used = 4, s.n_ff_exp = 64;
  s.idx_heads = 4, s.idx_dim = 64, s.idx_top_k = 8;
  s.n_ctx = 256;
  s.matrix_type = gguf::GgmlType::Q8_0;
  model::write_synthetic_model(s, dir.file("m.gguf"));
  std::vector<int32_t> ids;
  for (int i = 0; i < 40; ++i) ids.push_back((i * 37 + 11) % 512);
  for (int N : {2, 4, 8}) {
    Pair p(dir.file("m.gguf"), N, AttentionMode::Sparse);
    const std::string key = fmt::format("synthetic N={}", N);
    std::vector<int32_t> ta, tb;
    ASSERT_TRUE(p.cache.reserve(ta, int64_t(ids.size()) + 6));
    ASSERT_TRUE(p.replicas.reserve(tb, int64_t(ids.size()) + 6));
    double d = rel_diff(p.sharded({SeqInput{ids, 0, &tb, true}}), p.whole({SeqInput{ids, 0, &ta, true}}), 512, key);
    EXPECT_LE(d, kShardTol) << key;
    note(key, d);
    for (int i = 0; i < 6; ++i) {  // decode through the cache
      const int32_t next = (i * 101 + 7) % 512;
      const int64_t pos = int64_t(ids.size()) + i;
      d = rel_diff(p.sharded({SeqInput{{next}, pos, &tb, false}}), p.whole({SeqInput{{next}, pos, &ta, false}}), 512,
                   key + " decode");
      EXPECT_LE(d, kShardTol) << key << " decode " << i;
      note(key, d);
    }
  }
}

// The bundled model (trained, Q8_0, 8 heads, 8 experts) at 8 ranks: one head and one expert each.
TEST(TensorParallelSynthetic, TheBundledTrainedModelAtEightRanks) {
  const std::string path = std::string(SPARSEMLA_FIXTURES) + "/../../models/tiny-glm5-q8_0.gguf";
  Pair p(path, 8, AttentionMode::Sparse);
  const int64_t V = p.m->hparams().n_vocab;
  std::vector<int32_t> ids;
  for (int i = 0; i < 96; ++i) ids.push_back(int32_t((i * 733 + 29) % V));  // longer than top-k 64: the indexer selects
  ASSERT_GT(ids.size(), p.m->hparams().idx_top_k);
  std::vector<int32_t> ta, tb;
  ASSERT_TRUE(p.cache.reserve(ta, int64_t(ids.size())));
  ASSERT_TRUE(p.replicas.reserve(tb, int64_t(ids.size())));
  const double d = rel_diff(p.sharded({SeqInput{ids, 0, &tb, true}}), p.whole({SeqInput{ids, 0, &ta, true}}), V, "bundled N=8");
  EXPECT_LE(d, kShardTol);
  note("bundled model N=8", d);
}

// Prints the measured differences once all tests have run (for docs and reviews).
class PrintMeasured : public ::testing::Environment {
 public:
  void TearDown() override {
    for (const auto& [key, d] : measured()) std::printf("[ tensor parallel ] %-28s max |sharded - unsharded| / max |logit| = %.3g\n", key.c_str(), d);
  }
};
const auto* const kPrintMeasured = ::testing::AddGlobalTestEnvironment(new PrintMeasured);

}  // namespace
}  // namespace sparsemla::dist
