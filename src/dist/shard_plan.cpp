#include "dist/shard_plan.h"

#include <fmt/format.h>

#include <map>

#include "gguf/reader.h"
#include "util/error.h"

namespace sparsemla::dist {

Slice TensorSplit::slice(int rank) const {
  Slice s{0, rows, 0, cols};
  if (axis == SplitAxis::Rows) {
    s.row0 = bounds[size_t(rank)];
    s.n_rows = bounds[size_t(rank) + 1] - s.row0;
  } else if (axis == SplitAxis::Cols) {
    s.col0 = bounds[size_t(rank)];
    s.n_cols = bounds[size_t(rank) + 1] - s.col0;
  }
  return s;
}

std::string TensorSplit::describe(const Slice& s) const {
  std::string d = fmt::format("{} x {}: rows [{}, {}) x columns [{}, {})", s.n_rows, s.n_cols, s.row0, s.row0 + s.n_rows,
                              s.col0, s.col0 + s.n_cols);
  if (axis == SplitAxis::Replicated || unit.empty()) return d;
  const int64_t first = axis == SplitAxis::Rows ? s.row0 : s.col0;
  const int64_t count = axis == SplitAxis::Rows ? s.n_rows : s.n_cols;
  if (count <= 0 || first % unit_size != 0 || count % unit_size != 0) return d;
  const int64_t u0 = first / unit_size, u1 = (first + count) / unit_size - 1;
  return d + (u0 == u1 ? fmt::format(" ({} {})", unit, u0) : fmt::format(" ({}s {}..{})", unit, u0, u1));
}

TensorTypes types_of(const gguf::File& f) {
  return [&f](const std::string& name) -> std::optional<gguf::GgmlType> {
    const gguf::TensorInfo* t = f.tensor(name);
    if (!t) return std::nullopt;
    return t->type;
  };
}

namespace {

// Builds the plan's entries; the first problem found is thrown.
class Planner {
 public:
  Planner(int n, const TensorTypes& types) : n_(n), types_(types) {}

  // An entry for `name` when the model has the tensor. `per_rank` along `axis` is even.
  void add(std::vector<TensorSplit>& out, const std::string& name, int64_t rows, int64_t cols, SplitAxis axis,
           const std::string& unit = "", int64_t unit_size = 1) {
    const auto type = type_of(name);
    if (!type) return;
    TensorSplit t = base(name, *type, rows, cols, axis, unit, unit_size);
    if (axis != SplitAxis::Replicated) {
      const int64_t len = axis == SplitAxis::Rows ? rows : cols;
      for (int r = 0; r <= n_; ++r) t.bounds.push_back(len / n_ * r);
    }
    out.push_back(std::move(t));
  }

  // A dense FFN (or the shared expert): down's input columns cut in whole blocks of its type (at
  // least 8 columns), gate and up rows cut at the same places.
  void add_ffn(std::vector<TensorSplit>& out, const std::string& gate, const std::string& up, const std::string& down,
               int64_t H, int64_t F) {
    const auto down_type = type_of(down);
    if (!down_type) return;
    const int64_t block = gguf::traits(*down_type).block_size;
    if (F % block != 0) fail("{}: {} input columns are not a whole number of {} blocks", down, F, gguf::type_name(*down_type));
    // Unquantized types are cut 8 columns at a time where F allows it: the GPU kernels read their
    // rows 8 values at a time.
    const int64_t bs = block < 8 && F % 8 == 0 ? 8 : block;
    std::vector<int64_t> bounds;
    for (int r = 0; r <= n_; ++r) bounds.push_back(F / bs * r / n_ * bs);
    for (const std::string& name : {gate, up})
      if (const auto type = type_of(name)) {
        TensorSplit t = base(name, *type, F, H, SplitAxis::Rows, "", 1);
        t.bounds = bounds;
        out.push_back(std::move(t));
      }
    TensorSplit d = base(down, *down_type, H, F, SplitAxis::Cols, "", 1);
    d.bounds = std::move(bounds);
    out.push_back(std::move(d));
  }

  std::optional<gguf::GgmlType> type_of(const std::string& name) const {
    return types_ ? types_(name) : std::optional<gguf::GgmlType>(gguf::GgmlType::F32);
  }

 private:
  static TensorSplit base(const std::string& name, gguf::GgmlType type, int64_t rows, int64_t cols, SplitAxis axis,
                          const std::string& unit, int64_t unit_size) {
    TensorSplit t;
    t.name = name;
    t.type = type;
    t.rows = rows;
    t.cols = cols;
    t.axis = axis;
    t.unit = unit;
    t.unit_size = unit_size;
    return t;
  }
  int n_;
  const TensorTypes& types_;
};

}  // namespace

ShardPlan ShardPlan::make(const model::HParams& hp, int n_ranks, const TensorTypes& types) {
  if (n_ranks < 1) fail("tensor parallel: {} ranks; give 1 or more", n_ranks);
  const int64_t N = n_ranks;
  const int64_t H = hp.n_embd, V = hp.n_vocab, n_head = hp.n_head, E = hp.n_expert;
  const int64_t nope = hp.qk_nope, rope = hp.qk_rope, vh = hp.v_head, qk = nope + rope;
  const int64_t q_lora = hp.q_lora_rank, kv_lora = hp.kv_lora_rank;
  if (n_head % N != 0) fail("tensor parallel over {} ranks: the model's {} attention heads do not divide by {}", N, n_head, N);
  if (E % N != 0) fail("tensor parallel over {} ranks: the model's {} routed experts do not divide by {}", N, E, N);
  if (V % N != 0) fail("tensor parallel over {} ranks: the vocabulary of {} tokens does not divide by {}", N, V, N);

  ShardPlan p;
  p.n_ranks_ = n_ranks;
  p.heads_ = n_head / N;
  p.experts_ = E / N;
  p.vocab_ = V / N;
  Planner pl(n_ranks, types);
  auto& out = p.tensors_;
  using enum SplitAxis;
  pl.add(out, "token_embd.weight", V, H, Rows, "token");
  // A file without output.weight ties the output head to token_embd: same tensor, same split.
  if (pl.type_of("output.weight")) pl.add(out, "output.weight", V, H, Rows, "token");
  else if (pl.type_of("token_embd.weight")) {
    TensorSplit tied = out.back();
    tied.name = "output.weight";
    out.push_back(std::move(tied));
  }

  for (uint32_t il = 0; il < hp.n_layer; ++il) {
    auto n = [il](const char* s) { return fmt::format("blk.{}.{}", il, s); };
    if (q_lora > 0) {
      pl.add(out, n("attn_q_a.weight"), q_lora, H, Replicated);
      pl.add(out, n("attn_q_b.weight"), n_head * qk, q_lora, Rows, "head", qk);
    } else {
      pl.add(out, n("attn_q.weight"), n_head * qk, H, Rows, "head", qk);
    }
    pl.add(out, n("attn_kv_a_mqa.weight"), kv_lora + rope, H, Replicated);
    pl.add(out, n("attn_k_b.weight"), n_head * kv_lora, nope, Rows, "head", kv_lora);
    pl.add(out, n("attn_v_b.weight"), n_head * vh, kv_lora, Rows, "head", vh);
    pl.add(out, n("attn_kv_b.weight"), n_head * (nope + vh), kv_lora, Rows, "head", nope + vh);
    const std::string o = n("attn_output.weight");
    if (const auto type = pl.type_of(o)) {
      const auto& tr = gguf::traits(*type);
      if ((p.heads_ * vh) % tr.block_size != 0)
        fail("tensor parallel over {} ranks: {} is {} (blocks of {} values) and each rank's {} heads x {} values = {} "
             "of its input columns, which is not a whole number of blocks",
             N, o, tr.name, tr.block_size, p.heads_, vh, p.heads_ * vh);
      pl.add(out, o, H, n_head * vh, Cols, "head", vh);
    }

    if (hp.has_indexer() && hp.idx_full[il]) {
      const int64_t ih = hp.idx_heads, id = hp.idx_dim;
      pl.add(out, n("indexer.attn_q_b.weight"), ih * id, q_lora, Replicated);
      pl.add(out, n("indexer.attn_k.weight"), id, H, Replicated);
      pl.add(out, n("indexer.proj.weight"), ih, H, Replicated);
    }

    if (!hp.is_moe_layer(il)) {
      pl.add_ffn(out, n("ffn_gate.weight"), n("ffn_up.weight"), n("ffn_down.weight"), H, hp.n_ff);
    } else {
      const int64_t Fe = hp.n_ff_exp;
      pl.add(out, n("ffn_gate_inp.weight"), E, H, Replicated);
      pl.add(out, n("ffn_gate_exps.weight"), E * Fe, H, Rows, "expert", Fe);
      pl.add(out, n("ffn_up_exps.weight"), E * Fe, H, Rows, "expert", Fe);
      pl.add(out, n("ffn_down_exps.weight"), E * H, Fe, Rows, "expert", H);
      if (hp.n_expert_shared > 0)
        pl.add_ffn(out, n("ffn_gate_shexp.weight"), n("ffn_up_shexp.weight"), n("ffn_down_shexp.weight"), H,
                   Fe * hp.n_expert_shared);
    }
  }
  return p;
}

const TensorSplit* ShardPlan::find(const std::string& name) const {
  for (const TensorSplit& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

std::string ShardPlan::summary() const {
  std::string s = fmt::format(
      "tensor parallel over {} ranks: per rank {} attention heads, {} routed experts, {} vocabulary rows",
      n_ranks_, heads_, experts_, vocab_);
  // FFN input columns per rank, one entry per distinct split (uneven only for small models).
  std::map<std::string, std::vector<std::string>> ffn;  // "256/256 (q8_0)" -> tensor names
  for (const TensorSplit& t : tensors_) {
    const bool shared = t.name.ends_with("ffn_down_shexp.weight");
    if (t.axis != SplitAxis::Cols || !(shared || t.name.ends_with("ffn_down.weight"))) continue;
    std::string widths;
    for (int r = 0; r < n_ranks_; ++r) widths += fmt::format("{}{}", r ? "/" : "", t.bounds[size_t(r) + 1] - t.bounds[size_t(r)]);
    ffn[fmt::format("{} {}", shared ? "shared expert" : "dense FFN", widths)].push_back(t.name);
  }
  for (const auto& [what, names] : ffn) s += fmt::format(", {} columns ({} layer(s))", what, names.size());
  return s + "; replicated: q_a, kv_a, the indexer, the router, the latent KV cache";
}

}  // namespace sparsemla::dist
