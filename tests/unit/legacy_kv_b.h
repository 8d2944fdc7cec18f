// Test models with the legacy fused attn_kv_b ({kv_lora, n_head*(nope+v)}: per head nope k-rows
// then v v-rows) instead of attn_k_b / attn_v_b, rebuilt from an F32 fixture.
#pragma once
#include <string>
#include <vector>

#include "gguf/reader.h"
#include "gguf/writer.h"
#include "model/hparams.h"
#include "util/error.h"

namespace sparsemla::test {

inline void write_legacy_kv_b(const std::string& src, const std::string& dst) {
  auto f = gguf::File::open(src);
  const model::HParams hp = model::load_hparams(*f);
  gguf::Writer w(f->alignment());
  for (const auto& [k, v] : f->metadata()) w.set(k, v);
  const int64_t nope = hp.qk_nope, vh = hp.v_head, kvl = hp.kv_lora_rank, nh = hp.n_head;
  for (const auto& t : f->tensors()) {
    const std::string& n = t.name;
    if (n.find("attn_v_b") != std::string::npos) continue;
    if (n.find("attn_k_b") != std::string::npos) {
      if (t.type != gguf::GgmlType::F32) fail("write_legacy_kv_b: {} is not F32", n);
      const std::string blk = n.substr(0, n.find("attn_k_b"));
      const float* kb = reinterpret_cast<const float*>(t.data);                                    // [nh][kvl][nope]
      const float* vb = reinterpret_cast<const float*>(f->tensor(blk + "attn_v_b.weight")->data);  // [nh][vh][kvl]
      std::vector<float> kvb(size_t(nh * (nope + vh) * kvl));                                      // [nh*(nope+vh)][kvl]
      for (int64_t h = 0; h < nh; ++h) {
        for (int64_t i = 0; i < nope; ++i)
          for (int64_t c = 0; c < kvl; ++c) kvb[size_t((h * (nope + vh) + i) * kvl + c)] = kb[(h * kvl + c) * nope + i];
        for (int64_t j = 0; j < vh; ++j)
          for (int64_t c = 0; c < kvl; ++c) kvb[size_t((h * (nope + vh) + nope + j) * kvl + c)] = vb[(h * vh + j) * kvl + c];
      }
      w.add_tensor(blk + "attn_kv_b.weight", gguf::GgmlType::F32, {kvl, nh * (nope + vh)}, kvb);
      continue;
    }
    w.add_tensor_bytes(n, t.type, std::vector<int64_t>(t.ne, t.ne + t.n_dims),
                       std::vector<uint8_t>(t.data, t.data + t.nbytes));
  }
  w.write(dst);
}

}  // namespace sparsemla::test
