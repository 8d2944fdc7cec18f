// `sparsemla write-gguf --spec SPEC.json -o OUT.gguf`: the project's GGUF writer driven from a JSON
// description, so that reference scripts (Python, transformers) produce model files exactly as the
// engine's own writer does. SPEC:
//   {"metadata": [{"key": K, "type": "u32|i32|u64|i64|f32|f64|bool|string|u8|i8|u16|i16", "value": V}
//                 | {"key": K, "type": "array", "elem": T, "value": [...]} ...],
//    "copy_metadata_from": {"file": GGUF, "prefix": "tokenizer."},      (optional)
//    "tensors": [{"name": N, "shape": [ne0, ne1, ...], "type": "f32|f16|bf16|q8_0|q4_0|q4_K|...",
//                 "data": "file of float32 values, ne0 fastest"} ...]}
// Relative data paths are relative to the spec's folder.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "gguf/reader.h"
#include "gguf/writer.h"
#include "util/error.h"

namespace sparsemla::app {
namespace {

gguf::Value scalar(const std::string& type, const nlohmann::json& v, const std::string& key) {
  try {
    if (type == "u8") return gguf::Value::u8(v.get<uint8_t>());
    if (type == "i8") return gguf::Value::i8(v.get<int8_t>());
    if (type == "u16") return gguf::Value::u16(v.get<uint16_t>());
    if (type == "i16") return gguf::Value::i16(v.get<int16_t>());
    if (type == "u32") return gguf::Value::u32(v.get<uint32_t>());
    if (type == "i32") return gguf::Value::i32(v.get<int32_t>());
    if (type == "u64") return gguf::Value::u64(v.get<uint64_t>());
    if (type == "i64") return gguf::Value::i64(v.get<int64_t>());
    if (type == "f32") return gguf::Value::f32(v.get<float>());
    if (type == "f64") return gguf::Value::f64(v.get<double>());
    if (type == "bool") return gguf::Value::boolean(v.get<bool>());
    if (type == "string") return gguf::Value::string(v.get<std::string>());
  } catch (const nlohmann::json::exception& e) {
    fail("spec: key '{}': value {} is not a {}: {}", key, v.dump(), type, e.what());
  }
  fail("spec: key '{}': unknown type '{}'", key, type);
}

gguf::ValueType value_type_of(const std::string& type, const std::string& key) {
  return scalar(type, type == "string" ? nlohmann::json("") : type == "bool" ? nlohmann::json(false) : nlohmann::json(0),
                key)
      .type();
}

std::vector<float> read_floats(const std::filesystem::path& p, uint64_t n) {
  std::ifstream in(p, std::ios::binary);
  if (!in) fail("{}: cannot open", p.string());
  std::vector<float> v(n);
  in.read(reinterpret_cast<char*>(v.data()), std::streamsize(n * sizeof(float)));
  if (uint64_t(in.gcount()) != n * sizeof(float))
    fail("{}: holds {} bytes, the tensor needs {}", p.string(), in.gcount(), n * sizeof(float));
  return v;
}

int run_write_gguf(const std::string& spec_path, const std::string& out, int split_tensors) {
  std::ifstream in(spec_path);
  if (!in) fail("{}: cannot open", spec_path);
  nlohmann::json spec;
  try {
    spec = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: invalid JSON: {}", spec_path, e.what());
  }
  const auto dir = std::filesystem::path(spec_path).parent_path();
  gguf::Writer w;
  for (const auto& m : spec.value("metadata", nlohmann::json::array())) {
    const std::string key = m.at("key"), type = m.at("type");
    if (type == "array") {
      const std::string elem = m.at("elem");
      std::vector<gguf::Value> items;
      for (const auto& v : m.at("value")) items.push_back(scalar(elem, v, key));
      w.set(key, gguf::Value::array(value_type_of(elem, key), std::move(items)));
    } else {
      w.set(key, scalar(type, m.at("value"), key));
    }
  }
  if (spec.contains("copy_metadata_from")) {
    const auto& c = spec["copy_metadata_from"];
    auto src = gguf::File::open(c.at("file").get<std::string>());
    const std::string prefix = c.value("prefix", "");
    for (const auto& [k, v] : src->metadata())
      if (k.rfind(prefix, 0) == 0) w.set(k, v);
  }
  for (const auto& t : spec.value("tensors", nlohmann::json::array())) {
    const std::string name = t.at("name"), type = t.at("type");
    const std::vector<int64_t> shape = t.at("shape");
    const auto gt = gguf::type_from_name(type);
    if (!gt) fail("spec: tensor '{}': unknown type '{}'", name, type);
    uint64_t n = 1;
    for (int64_t d : shape) n *= uint64_t(d);
    w.add_tensor(name, *gt, shape, read_floats(dir / t.at("data").get<std::string>(), n));
  }
  if (split_tensors > 0) {
    std::string prefix = out;
    if (prefix.size() > 5 && prefix.substr(prefix.size() - 5) == ".gguf") prefix.resize(prefix.size() - 5);
    for (const auto& p : w.write_split(prefix, size_t(split_tensors))) std::printf("wrote %s\n", p.c_str());
  } else {
    w.write(out);
    std::printf("wrote %s\n", out.c_str());
  }
  return 0;
}

}  // namespace

Runner add_write_gguf(CLI::App& app) {
  auto spec = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  auto split = std::make_shared<int>(0);
  CLI::App* cmd = app.add_subcommand("write-gguf", "Write a GGUF file from a JSON spec and float32 tensor files");
  cmd->add_option("--spec", *spec, "JSON spec (see apps/sparsemla/write_gguf.cpp)")->required();
  cmd->add_option("--output,-o", *out, "output .gguf")->required();
  cmd->add_option("--split-tensors", *split, "write NAME-0000k-of-0000n.gguf parts of this many tensors");
  return [=] { return run_write_gguf(*spec, *out, *split); };
}

}  // namespace sparsemla::app
