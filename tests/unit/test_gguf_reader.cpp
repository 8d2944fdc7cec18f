// GGUF reader and writer: round trips of every metadata type, split files against whole files,
// the fixtures as llama.cpp's converter wrote them, the malformed corpus, and how little of a large
// file inspection reads.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
#include <sys/stat.h>

#include <cstring>
#include <functional>
#include <fstream>
#include <random>

#include "gguf/quants.h"
#include "gguf/reader.h"
#include "gguf/writer.h"
#include "model/describe.h"
#include "test_util.h"
#include "util/error.h"
#include "util/half.h"

namespace sparsemla::gguf {
namespace {

using test::error_of;

using test::TempDir;

TEST(GgufWriterReader, EveryMetadataTypeRoundTrips) {
  TempDir dir("kv");
  Writer w(64);
  std::vector<std::pair<std::string, Value>> want = {
      {"t.u8", Value::u8(250)},
      {"t.i8", Value::i8(-120)},
      {"t.u16", Value::u16(65000)},
      {"t.i16", Value::i16(-32000)},
      {"t.u32", Value::u32(4000000000u)},
      {"t.i32", Value::i32(-2000000000)},
      {"t.u64", Value::u64(18000000000000000000ull)},
      {"t.i64", Value::i64(-9000000000000000000ll)},
      {"t.f32", Value::f32(1.5e-3f)},
      {"t.f64", Value::f64(-2.25e300)},
      {"t.bool", Value::boolean(true)},
      {"t.str", Value::string("héllo ｜ wörld\n\"quoted\"")},
      {"t.empty_str", Value::string("")},
      {"t.arr_str", Value::string_array({"a", "", "[gMASK]"})},
      {"t.arr_empty", Value::array(ValueType::INT32, {})},
      {"t.arr_bool", Value::bool_array({true, false, true})},
      {"t.nested", Value::array(ValueType::ARRAY, {Value::i32_array({1, 2, 3}),
                                                   Value::array(ValueType::ARRAY, {Value::string_array({"x"})}),
                                                   Value::f32_array({})})},
  };
  for (const auto& [k, v] : want) w.set(k, v);
  w.add_tensor("x", GgmlType::F32, {8, 2}, std::vector<float>(16, 1.0f));
  w.write(dir.file("kv.gguf"));

  auto f = File::open(dir.file("kv.gguf"));
  EXPECT_EQ(f->version(), 3u);
  EXPECT_EQ(f->alignment(), 64u);
  ASSERT_EQ(f->metadata().size(), want.size() + 1);  // + general.alignment
  for (const auto& [k, v] : want) {
    const Value* got = f->find(k);
    ASSERT_NE(got, nullptr) << k;
    EXPECT_EQ(*got, v) << k << ": " << got->to_string();
  }
  EXPECT_EQ(f->get_uint("t.u64"), 18000000000000000000ull);
  EXPECT_EQ(f->get_int("t.i8"), -120);
  EXPECT_EQ(f->get_string("t.str"), "héllo ｜ wörld\n\"quoted\"");
  EXPECT_FALSE(f->get_string("absent").has_value());
  EXPECT_EQ(f->tensor("x")->offset % 64, 0u);
}

TEST(GgufWriterReader, TypedGetterNamesKeyOnWrongType) {
  TempDir dir("getter");
  Writer w;
  w.set("general.architecture", Value::string("glm-dsa"));
  w.set("glm-dsa.block_count", Value::string("four"));
  w.write(dir.file("g.gguf"));
  auto f = File::open(dir.file("g.gguf"));
  const std::string msg = error_of([&] { f->get_uint("glm-dsa.block_count"); });
  EXPECT_NE(msg.find("g.gguf: key 'glm-dsa.block_count': expected a non-negative integer, found string \"four\""),
            std::string::npos)
      << msg;
}

TEST(GgufWriterReader, TensorBytesMatchTheirEncoding) {
  TempDir dir("tensors");
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> vals(64 * 3);
  for (float& v : vals) v = nd(rng);
  Writer w;
  for (GgmlType t : {GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0})
    w.add_tensor(std::string(type_name(t)), t, {64, 3}, vals);
  w.add_tensor_bytes("raw_q4k", GgmlType::Q4_K, {256}, std::vector<uint8_t>(144, 0x5a));
  w.write(dir.file("t.gguf"));

  auto f = File::open(dir.file("t.gguf"));
  for (GgmlType t : {GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0}) {
    const TensorInfo* ti = f->tensor(type_name(t));
    ASSERT_NE(ti, nullptr);
    EXPECT_EQ(ti->type, t);
    EXPECT_EQ(ti->ne[0], 64);
    EXPECT_EQ(ti->ne[1], 3);
    EXPECT_EQ(ti->nbytes, row_bytes(t, 64) * 3);
    std::vector<uint8_t> expect(ti->nbytes);
    for (int r = 0; r < 3; ++r) quantize_row(t, vals.data() + r * 64, expect.data() + r * row_bytes(t, 64), 64);
    EXPECT_EQ(std::memcmp(ti->data, expect.data(), expect.size()), 0) << type_name(t);
  }
  // F32 and F16 are checked against the value itself, not the writer's own encoder.
  const TensorInfo* f32 = f->tensor("f32");
  for (size_t i = 0; i < vals.size(); ++i) {
    float v;
    std::memcpy(&v, f32->data + 4 * i, 4);
    EXPECT_EQ(v, vals[i]);
  }
  const TensorInfo* raw = f->tensor("raw_q4k");
  EXPECT_EQ(raw->data[0], 0x5a);
  EXPECT_EQ(raw->data[143], 0x5a);
}

TEST(GgufReader, ReadsTheGlmFixtureAsLlamaCppWroteIt) {
  auto f = File::open(test::fixture_path("glm_pub/model-f32.gguf"));
  EXPECT_EQ(f->architecture(), "glm-dsa");
  EXPECT_EQ(f->tensors().size(), 95u);
  const TensorInfo* kb = f->tensor("blk.0.attn_k_b.weight");
  ASSERT_NE(kb, nullptr);
  // {nope 16, kv_lora 24, heads 2} per the fixture README
  EXPECT_EQ(kb->n_dims, 3u);
  EXPECT_EQ(kb->ne[0], 16);
  EXPECT_EQ(kb->ne[1], 24);
  EXPECT_EQ(kb->ne[2], 2);
  EXPECT_EQ(f->get_array("tokenizer.ggml.tokens")->items.size(), 1024u);
  EXPECT_NE(f->tensor("blk.3.nextn.eh_proj.weight"), nullptr);
}

// Copies every key and tensor of `src` into a writer, unchanged.
Writer copy_of(const File& src) {
  Writer w(src.alignment());
  for (const auto& [k, v] : src.metadata()) w.set(k, v);
  for (const auto& t : src.tensors()) {
    std::vector<int64_t> ne(t.ne, t.ne + t.n_dims);
    w.add_tensor_bytes(t.name, t.type, ne, std::vector<uint8_t>(t.data, t.data + t.nbytes));
  }
  return w;
}

std::vector<float> dump(const TensorInfo& t) {
  std::vector<float> out(size_t(t.n_elements()));
  for (int64_t r = 0; r < t.n_rows(); ++r)
    dequantize_row(t.type, t.data + r * t.row_bytes(), out.data() + r * t.ne[0], t.ne[0]);
  return out;
}

// The report without its file lines (which name the paths).
std::string report_without_files(const File& f) {
  std::string r = model::describe(f, {.list_tensors = false});
  std::string out;
  size_t pos = 0;
  while (pos < r.size()) {
    size_t end = r.find('\n', pos);
    std::string line = r.substr(pos, end - pos);
    if (line.rfind("  [", 0) != 0 && line.rfind("GGUF version", 0) != 0) out += line + "\n";
    pos = end == std::string::npos ? r.size() : end + 1;
  }
  return out;
}

TEST(GgufSplit, SplitAndWholeInspectAndDumpIdentically) {
  TempDir dir("split");
  auto fixture = File::open(test::fixture_path("glm_pub/model-f32.gguf"));
  Writer w = copy_of(*fixture);
  w.write(dir.file("whole.gguf"));
  const auto parts = w.write_split(dir.file("glm"), 40);
  ASSERT_EQ(parts.size(), 3u);  // 95 tensors, 40 per part
  EXPECT_EQ(parts[0], dir.file("glm-00001-of-00003.gguf"));

  auto whole = File::open(dir.file("whole.gguf"));
  // Any part opens the whole model.
  for (const std::string& p : parts) {
    auto split = File::open(p);
    ASSERT_EQ(split->paths().size(), 3u);
    ASSERT_EQ(split->tensors().size(), whole->tensors().size());
    for (const auto& t : whole->tensors()) {
      const TensorInfo* s = split->tensor(t.name);
      ASSERT_NE(s, nullptr) << t.name;
      EXPECT_EQ(s->type, t.type);
      EXPECT_EQ(s->shape_string(), t.shape_string());
      EXPECT_EQ(dump(*s), dump(t)) << t.name;
    }
    // Every key of the whole file, plus the three split keys.
    EXPECT_EQ(split->metadata().size(), whole->metadata().size() + 3);
    EXPECT_EQ(report_without_files(*split), report_without_files(*whole));
  }
  // Both equal the fixture the converter wrote.
  for (const auto& t : fixture->tensors()) EXPECT_EQ(dump(*whole->tensor(t.name)), dump(t));
}

TEST(GgufSplit, TensorsAreSpreadOverTheParts) {
  TempDir dir("split2");
  auto fixture = File::open(test::fixture_path("dsv32_pub/model-f32.gguf"));
  const auto parts = copy_of(*fixture).write_split(dir.file("ds"), 1000, 300000);
  ASSERT_GT(parts.size(), 3u);
  auto split = File::open(parts.back());
  std::vector<size_t> per_file(parts.size());
  for (const auto& t : split->tensors()) per_file.at(t.file_index)++;
  for (size_t n : per_file) EXPECT_GT(n, 0u);
}

// Each hand-made malformed file is refused with its own message (see tests/malformed).
TEST(GgufReader, MalformedCorpusIsRefusedWithTheExpectedMessage) {
  const std::string dir = std::string(SPARSEMLA_TEST_DATA) + "/../malformed";
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().extension() != ".expect") continue;
    std::ifstream in(e.path());
    std::string target, want;
    std::getline(in, target);
    std::getline(in, want);
    const std::string msg = error_of([&] { File::open(dir + "/" + target); });
    EXPECT_NE(msg.find(want), std::string::npos) << target << ": " << msg;
    ++n;
  }
  EXPECT_GE(n, 40);
}

// rchar of /proc/self/io: bytes this process obtained through read()/pread() and friends.
uint64_t proc_rchar() {
  std::ifstream io("/proc/self/io");
  std::string key;
  uint64_t v = 0;
  while (io >> key >> v)
    if (key == "rchar:") return v;
  return 0;
}

// Inspecting a multi-GB model reads its header and nothing of its tensor data. Measured twice,
// independently of the reader's own count: by the kernel's count of bytes this process read
// (rchar in /proc/self/io), and by mincore() over the whole file mapping after the file's pages
// were dropped from the page cache: what is resident afterwards is everything the inspection
// brought in, the kernel's read-ahead included.
TEST(GgufReader, InspectingAFourGigabyteFileReadsUnderOneMegabyte) {
  TempDir dir("big");
  auto fixture = File::open(test::fixture_path("glm_pub/model-f32.gguf"));
  Writer w;
  for (const auto& [k, v] : fixture->metadata()) w.set(k, v);
  for (int i = 0; i < 4; ++i) w.add_tensor_zeros("blk." + std::to_string(i) + ".big", GgmlType::Q8_0, {32768, 31000});
  const std::string path = dir.file("big.gguf");
  w.write(path);
  const uint64_t size = std::filesystem::file_size(path);
  ASSERT_GT(size, 4ull << 30);
  {
    const int fd = ::open(path.c_str(), O_RDONLY);
    ASSERT_GE(fd, 0);
    ::fsync(fd);
    ASSERT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
    ::close(fd);
  }

  const uint64_t before = proc_rchar();
  auto f = File::open(path);
  const std::string report = model::describe(*f, {.list_tensors = true});
  const uint64_t read = proc_rchar() - before;
  EXPECT_LT(read, 1u << 20) << "bytes read: " << read;
  EXPECT_LE(read, f->header_bytes_read() + 4096);  // + the read of /proc/self/io itself

  const long page = sysconf(_SC_PAGESIZE);
  const TensorInfo& t0 = f->tensors()[0];
  const uint8_t* base = t0.data - t0.offset;  // the mapping starts at file offset 0
  std::vector<unsigned char> vec((size + page - 1) / page);
  ASSERT_EQ(mincore(const_cast<uint8_t*>(base), size, vec.data()), 0);
  uint64_t resident = 0;
  for (unsigned char v : vec) resident += v & 1;
  EXPECT_LT(resident * page, 1u << 20) << resident << " pages resident";
  std::printf("inspecting a %.2f GB file: %llu bytes read, %llu pages (%llu KiB) of it resident\n", size / 1e9,
              static_cast<unsigned long long>(read), static_cast<unsigned long long>(resident),
              static_cast<unsigned long long>(resident * page / 1024));
}

TEST(GgufReader, SplitNames) {
  auto s = parse_split_name("/m/GLM-5-Q4_K_M-00003-of-00010.gguf");
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->prefix, "/m/GLM-5-Q4_K_M");
  EXPECT_EQ(s->index, 3u);
  EXPECT_EQ(s->count, 10u);
  EXPECT_FALSE(parse_split_name("model.gguf").has_value());
  EXPECT_FALSE(parse_split_name("m-0001-of-0002.gguf").has_value());
  EXPECT_EQ(split_path("/m/x", 2, 7), "/m/x-00002-of-00007.gguf");
}

TEST(GgufReader, RefusesDirectoriesAndFifos) {
  TempDir dir("fifo");
  EXPECT_NE(error_of([&] { File::open(dir.path().string()); }).find("not a regular file"), std::string::npos);
  ASSERT_EQ(mkfifo(dir.file("pipe.gguf").c_str(), 0600), 0);
  EXPECT_NE(error_of([&] { File::open(dir.file("pipe.gguf")); }).find("not a regular file"), std::string::npos);
  EXPECT_NE(error_of([&] { File::open(dir.file("absent.gguf")); }).find("cannot open"), std::string::npos);
}

}  // namespace
}  // namespace sparsemla::gguf
