#include "model/describe.h"

#include <fmt/format.h>

#include <map>

#include "gguf/reader.h"
#include "model/hparams.h"
#include "util/error.h"

namespace sparsemla::model {
namespace {

std::string human_bytes(uint64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = double(b);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{} B", b) : fmt::format("{:.2f} {}", v, units[u]);
}

void describe_hparams(std::string& out, const HParams& hp) {
  auto row = [&](std::string_view name, const std::string& value, std::string_view note = {}) {
    out += fmt::format("  {:<24} {}{}{}\n", name, value, note.empty() ? "" : "  ", note);
  };
  row("layers", fmt::format("{} main + {} next-n (MTP)", hp.n_layer, hp.n_nextn),
      fmt::format("block_count {}", hp.n_layer_total));
  row("leading dense layers", fmt::format("{}", hp.n_leading_dense));
  row("hidden size", fmt::format("{}", hp.n_embd));
  row("vocabulary", fmt::format("{}", hp.n_vocab));
  row("training context", fmt::format("{}", hp.n_ctx_train));
  row("rms_norm_eps", fmt::format("{:g}", hp.rms_eps));
  row("attention heads", fmt::format("{} (kv heads in file: {})", hp.n_head, hp.n_head_kv));
  row("q_lora_rank", hp.q_lora_rank ? fmt::format("{}", hp.q_lora_rank) : "none (attn_q)");
  row("kv_lora_rank", fmt::format("{}", hp.kv_lora_rank));
  row("qk_nope", fmt::format("{}", hp.qk_nope),
      hp.legacy_kv_b ? "= key_length - rope dims (legacy attn_kv_b layout)" : "= key_length_mla - rope dims");
  row("qk_rope", fmt::format("{}", hp.qk_rope));
  row("v_head", fmt::format("{}", hp.v_head));
  row("latent cache per token", fmt::format("{} values", hp.kv_lora_rank + hp.qk_rope), "= kv_lora_rank + qk_rope");
  row("softmax scale", fmt::format("{:.6g}", hp.softmax_scale()),
      hp.yarn_mscale() != 1.0f ? fmt::format("= (nope+rope)^-0.5 * mscale^2, mscale {:.6g}", hp.yarn_mscale())
                               : "= (nope+rope)^-0.5");
  row("rope theta", fmt::format("{:g}", hp.rope_theta));
  if (hp.rope_scaling == RopeScaling::Yarn)
    row("rope scaling", fmt::format("yarn factor {:g}, original context {}, beta fast {:g} slow {:g}, log mul {:g}",
                                    hp.rope_factor, hp.rope_orig_ctx, hp.yarn_beta_fast, hp.yarn_beta_slow,
                                    hp.yarn_log_mul));
  else if (hp.rope_scaling == RopeScaling::Linear)
    row("rope scaling", fmt::format("linear factor {:g}", hp.rope_factor));
  else
    row("rope scaling", "none");
  row("dense ffn", fmt::format("{}", hp.n_ff));
  if (hp.n_expert) {
    row("experts", fmt::format("{} routed, {} used, {} shared, ffn {}", hp.n_expert, hp.n_expert_used,
                               hp.n_expert_shared, hp.n_ff_exp));
    row("expert groups", fmt::format("{} groups, {} used", hp.n_expert_groups, hp.n_group_used));
    row("expert gating", hp.expert_gating == 2 ? "sigmoid" : "softmax");
    row("expert weights", fmt::format("scale {:g}, normalized: {}", hp.expert_weights_scale,
                                      hp.expert_weights_norm ? "yes" : "no"));
  }
  if (hp.has_indexer()) {
    row("indexer", fmt::format("{} heads x {} dims, top-k {}", hp.idx_heads, hp.idx_dim, hp.idx_top_k));
    row("indexer rope", hp.idx_rope_interleaved ? "interleaved pairs" : "half split (not interleaved)");
    std::string types;
    uint32_t n_full = 0;
    for (size_t i = 0; i < hp.idx_full.size(); ++i) {
      types += hp.idx_full[i] ? 'F' : 's';
      n_full += hp.idx_full[i];
    }
    row("indexer layers", fmt::format("{} full, {} shared", n_full, hp.idx_full.size() - n_full),
        fmt::format("[{}] (F full, s shared/IndexShare)", types));
  } else {
    row("attention", "dense MLA (no indexer)");
  }
  if (!hp.defaulted.empty()) {
    out += "  defaults applied (key absent from the file):\n";
    for (const auto& d : hp.defaulted) out += fmt::format("    {}\n", d);
  }
}

void describe_tokenizer(std::string& out, const gguf::File& f) {
  const auto model = f.get_string("tokenizer.ggml.model");
  if (!model) {
    out += "tokenizer: none in this file\n";
    return;
  }
  const auto* tokens = f.get_array("tokenizer.ggml.tokens");
  const auto* merges = f.get_array("tokenizer.ggml.merges");
  out += fmt::format("tokenizer: model {}, pre-tokenizer {}, {} tokens, {} merges\n", *model,
                     f.get_string("tokenizer.ggml.pre").value_or("(none)"), tokens ? tokens->items.size() : 0,
                     merges ? merges->items.size() : 0);
  const char* specials[] = {"bos", "eos", "eot", "eom", "unknown", "padding", "seperator", "mask"};
  for (const char* s : specials) {
    const auto id = f.get_uint(fmt::format("tokenizer.ggml.{}_token_id", s));
    if (!id) continue;
    std::string text = "(out of range)";
    if (tokens && *id < tokens->items.size() && tokens->items[*id].type() == gguf::ValueType::STRING)
      text = tokens->items[*id].to_string();
    out += fmt::format("  {:<10} {:>8}  {}\n", s, *id, text);
  }
  for (const char* flag : {"add_bos_token", "add_eos_token"})
    if (auto b = f.get_bool(fmt::format("tokenizer.ggml.{}", flag))) out += fmt::format("  {} {}\n", flag, *b);
  if (auto t = f.get_string("tokenizer.chat_template"))
    out += fmt::format("  chat template: {} bytes\n", t->size());
  else
    out += "  chat template: none (a built-in format is used)\n";
}

}  // namespace

std::string describe(const gguf::File& f, const DescribeOptions& opts) {
  std::string out;
  out += fmt::format("GGUF version {}, alignment {}, {} metadata keys, {} file(s)\n", f.version(), f.alignment(),
                     f.metadata().size(), f.paths().size());
  for (size_t i = 0; i < f.paths().size(); ++i) {
    size_t n = 0;
    for (const auto& t : f.tensors()) n += t.file_index == i;
    out += fmt::format("  [{}] {}  {}, {} tensors\n", i + 1, f.paths()[i], human_bytes(f.file_sizes()[i]), n);
  }

  const auto arch = f.get_string("general.architecture");
  Arch a;
  if (!arch) {
    out += "architecture: (general.architecture missing) -- cannot be run\n";
  } else if (!arch_from_name(*arch, &a)) {
    out += fmt::format("architecture: {} -- not supported, cannot be run (sparsemla runs glm-dsa, deepseek32, "
                       "deepseek2); metadata and tensors shown below\n",
                       *arch);
  } else {
    out += fmt::format("architecture: {}\n", *arch);
    try {
      describe_hparams(out, load_hparams(f));
    } catch (const Error& e) {
      out += fmt::format("  cannot run: {}\n", e.what());
    }
  }
  if (auto name = f.get_string("general.name")) out += fmt::format("name: {}\n", *name);
  describe_tokenizer(out, f);

  std::map<std::string, std::pair<size_t, uint64_t>> by_type;
  uint64_t total = 0;
  int64_t params = 0;
  for (const auto& t : f.tensors()) {
    auto& e = by_type[std::string(gguf::type_name(t.type))];
    e.first++;
    e.second += t.nbytes;
    total += t.nbytes;
    params += t.n_elements();
  }
  out += fmt::format("tensors: {}, {} parameters, {}\n", f.tensors().size(), params, human_bytes(total));
  for (const auto& [name, e] : by_type)
    out += fmt::format("  {:<8} {:>6} tensors  {:>12}\n", name, e.first, human_bytes(e.second));

  if (opts.list_tensors) {
    out += fmt::format("{:<48} {:<8} {:<24} {:>4} {:>14} {:>14}\n", "name", "type", "shape", "file", "offset",
                       "bytes");
    for (const auto& t : f.tensors())
      out += fmt::format("{:<48} {:<8} {:<24} {:>4} {:>14} {:>14}\n", t.name, gguf::type_name(t.type),
                         t.shape_string(), t.file_index + 1, t.offset, t.nbytes);
  }
  return out;
}

}  // namespace sparsemla::model
