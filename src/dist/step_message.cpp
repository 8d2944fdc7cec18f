#include "dist/step_message.h"

#include <cstring>

#include "util/error.h"

namespace sparsemla::dist {
namespace {

constexpr uint32_t kConfigMagic = 0x47464352;  // "RCFG"
constexpr uint32_t kStepMagic = 0x50455453;    // "STEP"
constexpr uint32_t kVersion = 2;  // 2: q8_two_level

class Writer {
 public:
  void u8(uint8_t v) { b_.push_back(v); }
  void u32(uint32_t v) { put(v, 4); }
  void u64(uint64_t v) { put(v, 8); }
  void i64(int64_t v) { put(uint64_t(v), 8); }
  void f32(float v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    u32(u);
  }
  void bytes(std::span<const uint8_t> s) {
    u64(s.size());
    b_.insert(b_.end(), s.begin(), s.end());
  }
  void ints(const std::vector<int32_t>& v) {
    u64(v.size());
    for (int32_t x : v) u32(uint32_t(x));
  }
  std::vector<uint8_t> take() { return std::move(b_); }

 private:
  void put(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) b_.push_back(uint8_t(v >> (8 * i)));
  }
  std::vector<uint8_t> b_;
};

// Reads fields in order; the first read past the end throws, naming the message and the field.
class Reader {
 public:
  Reader(std::span<const uint8_t> s, const char* what) : s_(s), what_(what) {}
  uint8_t u8(const char* f) { return uint8_t(get(1, f)); }
  uint32_t u32(const char* f) { return uint32_t(get(4, f)); }
  uint64_t u64(const char* f) { return get(8, f); }
  int64_t i64(const char* f) { return int64_t(get(8, f)); }
  float f32(const char* f) {
    const uint32_t u = u32(f);
    float v;
    std::memcpy(&v, &u, 4);
    return v;
  }
  std::vector<uint8_t> bytes(const char* f) {
    const uint64_t n = count(f, 1);
    std::vector<uint8_t> v(s_.begin() + long(pos_), s_.begin() + long(pos_ + n));
    pos_ += n;
    return v;
  }
  std::vector<int32_t> ints(const char* f) {
    const uint64_t n = count(f, 4);
    std::vector<int32_t> v(n);
    for (auto& x : v) x = int32_t(u32(f));
    return v;
  }
  // A length prefix, checked against the bytes left (each element at least `unit` bytes).
  uint64_t count(const char* f, uint64_t unit) {
    const uint64_t n = u64(f);
    if (n > (s_.size() - pos_) / unit) fail("{}: field {} claims {} elements, more than the message holds", what_, f, n);
    return n;
  }
  void end() const {
    if (pos_ != s_.size()) fail("{}: {} bytes left over after the last field", what_, s_.size() - pos_);
  }

 private:
  uint64_t get(int n, const char* f) {
    if (s_.size() - pos_ < size_t(n)) fail("{}: the message ends inside field {}", what_, f);
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= uint64_t(s_[pos_ + size_t(i)]) << (8 * i);
    pos_ += size_t(n);
    return v;
  }
  std::span<const uint8_t> s_;
  size_t pos_ = 0;
  const char* what_;
};

void check_header(Reader& r, uint32_t magic, const char* what) {
  const uint32_t m = r.u32("magic");
  if (m != magic) fail("{}: not one (magic {:#x}, expected {:#x})", what, m, magic);
  const uint32_t v = r.u32("version");
  if (v != kVersion) fail("{}: wire version {}, this build speaks {} (run the same sparsemla on every rank)", what, v, kVersion);
}

}  // namespace

std::vector<uint8_t> encode(const RankConfig& c) {
  Writer w;
  w.u32(kConfigMagic);
  w.u32(kVersion);
  w.bytes({reinterpret_cast<const uint8_t*>(c.arch.data()), c.arch.size()});
  w.u64(c.file_bytes);
  w.i64(c.n_vocab);
  w.u32(c.n_layer);
  w.u8(c.cuda);
  w.u8(c.host_staged);
  w.u8(c.kv_dtype);
  w.u8(c.precise);
  w.u8(c.dense_attention);
  w.u8(c.cuda_graphs);
  w.u8(c.int8_activations);
  w.u8(c.q8_two_level);
  w.u32(uint32_t(c.kv_blocks));
  w.u32(uint32_t(c.block_size));
  w.i64(c.batch_tokens);
  w.u32(uint32_t(c.threads));
  w.bytes(c.nccl_id);
  return w.take();
}

RankConfig decode_config(std::span<const uint8_t> bytes) {
  Reader r(bytes, "rank configuration from rank 0");
  check_header(r, kConfigMagic, "rank configuration from rank 0");
  RankConfig c;
  const std::vector<uint8_t> arch = r.bytes("arch");
  c.arch.assign(arch.begin(), arch.end());
  c.file_bytes = r.u64("file_bytes");
  c.n_vocab = r.i64("n_vocab");
  c.n_layer = r.u32("n_layer");
  c.cuda = r.u8("cuda") != 0;
  c.host_staged = r.u8("host_staged") != 0;
  c.kv_dtype = r.u8("kv_dtype");
  c.precise = r.u8("precise") != 0;
  c.dense_attention = r.u8("dense_attention") != 0;
  c.cuda_graphs = r.u8("cuda_graphs") != 0;
  c.int8_activations = r.u8("int8_activations") != 0;
  c.q8_two_level = r.u8("q8_two_level") != 0;
  c.kv_blocks = int32_t(r.u32("kv_blocks"));
  c.block_size = int32_t(r.u32("block_size"));
  c.batch_tokens = r.i64("batch_tokens");
  c.threads = int32_t(r.u32("threads"));
  c.nccl_id = r.bytes("nccl_id");
  r.end();
  return c;
}

RankStep RankStep::of(Kind kind, const std::vector<model::SeqInput>& batch) {
  RankStep s;
  s.kind = kind;
  for (const model::SeqInput& in : batch) {
    StepSeq q;
    q.tokens = in.tokens;
    q.pos0 = in.pos0;
    if (in.block_table) q.block_table = *in.block_table;
    q.all_logits = in.all_logits;
    s.seqs.push_back(std::move(q));
  }
  return s;
}

std::vector<model::SeqInput> RankStep::inputs() const {
  std::vector<model::SeqInput> out;
  for (const StepSeq& q : seqs) out.push_back({q.tokens, q.pos0, &q.block_table, q.all_logits});
  return out;
}

std::vector<uint8_t> encode(const RankStep& s) {
  Writer w;
  w.u32(kStepMagic);
  w.u32(kVersion);
  w.u32(uint32_t(s.kind));
  w.i64(s.n);
  w.u64(s.seqs.size());
  for (const StepSeq& q : s.seqs) {
    w.ints(q.tokens);
    w.i64(q.pos0);
    w.ints(q.block_table);
    w.u8(q.all_logits);
  }
  w.u64(s.rows.size());
  for (const StepSampling& p : s.rows) {
    w.f32(p.temperature);
    w.f32(p.top_p);
    w.u32(uint32_t(p.top_k));
    w.f32(p.min_p);
    w.u64(p.seed);
    w.u64(p.step);
  }
  return w.take();
}

RankStep decode_step(std::span<const uint8_t> bytes) {
  Reader r(bytes, "step from rank 0");
  check_header(r, kStepMagic, "step from rank 0");
  RankStep s;
  const uint32_t kind = r.u32("kind");
  if (kind < 1 || kind > 4) fail("step from rank 0: unknown kind {}", kind);
  s.kind = RankStep::Kind(kind);
  s.n = r.i64("n");
  const uint64_t n_seqs = r.count("seqs", 25);
  for (uint64_t i = 0; i < n_seqs; ++i) {
    StepSeq q;
    q.tokens = r.ints("tokens");
    q.pos0 = r.i64("pos0");
    q.block_table = r.ints("block_table");
    q.all_logits = r.u8("all_logits") != 0;
    s.seqs.push_back(std::move(q));
  }
  const uint64_t n_rows = r.count("rows", 32);
  for (uint64_t i = 0; i < n_rows; ++i) {
    StepSampling p;
    p.temperature = r.f32("temperature");
    p.top_p = r.f32("top_p");
    p.top_k = int32_t(r.u32("top_k"));
    p.min_p = r.f32("min_p");
    p.seed = r.u64("seed");
    p.step = r.u64("step");
    s.rows.push_back(p);
  }
  r.end();
  return s;
}

}  // namespace sparsemla::dist
