// `sparsemla inspect FILE`: what a GGUF model holds, without loading its weights.
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "commands.h"
#include "gguf/quants.h"
#include "gguf/reader.h"
#include "model/describe.h"
#include "model/hparams.h"
#include "ops/device.h"
#include "ops/select/select.h"
#include "util/error.h"

namespace sparsemla::app {
namespace {

struct InspectArgs {
  std::string path;
  bool tensors = false;
  bool metadata = false;
  std::string tensor;
  std::string dump;
  bool backends = false;
  std::string cache = "bf16";
  std::string attention = "sparse";
  int tensor_parallel = 1;
};

// The attention backends the selector picks for this model on every GPU here (or the CPU), with
// the reason each candidate was taken or refused.
std::string backends_report(const gguf::File& f, const InspectArgs& a) {
  const model::HParams hp = model::load_hparams(f);
  std::string why;
  const std::vector<ops::DeviceInfo> devs = ops::list_devices(&why);
  std::string out;
  const bool sparse = a.attention == "sparse";
  const bool fp8 = a.cache == "fp8";
  if (devs.empty()) {
    out += fmt::format("no GPU: {}\n", why);
    const ops::AttentionProblem p = ops::attention_problem(hp, nullptr, sparse, fp8, a.tensor_parallel);
    out += ops::format_plan(p, ops::select_backends(p));
  }
  for (const ops::DeviceInfo& d : devs) {
    const ops::AttentionProblem p = ops::attention_problem(hp, &d, sparse, fp8, a.tensor_parallel);
    out += fmt::format("GPU {}: ", d.index) + ops::format_plan(p, ops::select_backends(p));
  }
  return out;
}

// Writes a tensor dequantized to little-endian float32 in ggml order (ne0 fastest), row by row.
void dump_tensor(const gguf::TensorInfo& t, const std::string& out_path) {
  std::ofstream out(out_path, std::ios::binary);
  if (!out) fail("{}: cannot create", out_path);
  std::vector<float> row(size_t(t.ne[0]));
  const uint64_t rb = t.row_bytes();
  for (int64_t r = 0; r < t.n_rows(); ++r) {
    gguf::dequantize_row(t.type, t.data + uint64_t(r) * rb, row.data(), t.ne[0]);
    out.write(reinterpret_cast<const char*>(row.data()), std::streamsize(row.size() * sizeof(float)));
  }
  if (!out) fail("{}: write failed", out_path);
}

int run_inspect(const InspectArgs& a) {
  auto f = gguf::File::open(a.path);
  if (!a.dump.empty() || !a.tensor.empty()) {
    if (a.tensor.empty()) fail("--dump needs --tensor NAME");
    const gguf::TensorInfo* t = f->tensor(a.tensor);
    if (!t) fail("{}: no tensor named '{}' ({} tensors; list them with --tensors)", a.path, a.tensor,
                 f->tensors().size());
    if (a.dump.empty()) fail("--tensor needs --dump OUT.f32");
    dump_tensor(*t, a.dump);
    std::printf("wrote %s: %s %s, %lld floats\n", a.dump.c_str(), std::string(gguf::type_name(t->type)).c_str(),
                t->shape_string().c_str(), static_cast<long long>(t->n_elements()));
    return 0;
  }
  if (a.backends) {
    const std::string r = backends_report(*f, a);
    std::fwrite(r.data(), 1, r.size(), stdout);
    return 0;
  }
  model::DescribeOptions opts;
  opts.list_tensors = a.tensors;
  std::string report = model::describe(*f, opts);
  if (a.metadata) {
    report += "metadata:\n";
    for (const auto& [k, v] : f->metadata())
      report += fmt::format("  {} ({}) = {}\n", k, gguf::value_type_name(v.type()), v.to_string());
  }
  report += fmt::format("header bytes read: {}\n", f->header_bytes_read());
  std::fwrite(report.data(), 1, report.size(), stdout);
  return 0;
}

}  // namespace

Runner add_inspect(CLI::App& app) {
  auto args = std::make_shared<InspectArgs>();
  CLI::App* cmd = app.add_subcommand("inspect", "Show a GGUF model's architecture, hyperparameters, tokenizer and tensors");
  cmd->add_option("file", args->path, "GGUF file (any part of a split model)")->required();
  cmd->add_flag("--tensors", args->tensors, "List every tensor: name, type, shape, file, offset");
  cmd->add_flag("--metadata", args->metadata, "Print every metadata key and value");
  cmd->add_option("--tensor", args->tensor, "Tensor to dump (with --dump)");
  cmd->add_option("--dump", args->dump, "Write --tensor dequantized as little-endian float32, ne0 fastest");
  cmd->add_flag("--backends", args->backends,
                "Show the attention kernels chosen for this model on each GPU (or the CPU), and why each candidate was "
                "taken or refused");
  cmd->add_option("--cache-dtype", args->cache, "with --backends: bf16 or fp8 KV cache")->check(CLI::IsMember({"bf16", "fp8"}));
  cmd->add_option("--attention", args->attention, "with --backends: sparse or dense")->check(CLI::IsMember({"sparse", "dense"}));
  cmd->add_option("--tensor-parallel", args->tensor_parallel, "with --backends: GPUs the heads are split over")
      ->check(CLI::Range(1, 64));
  return [args] { return run_inspect(*args); };
}

}  // namespace sparsemla::app
