// Renders each case of tests/data/jinja/cases.json with src/chat and compares the output with the one
// Python's jinja2 gave (configured as Hugging Face transformers configures it) byte for byte. The
// file is written by scripts/reference/make_jinja_cases.py. Cases where jinja2 raised must raise a
// TemplateError here too, at the same stage (parse or render), naming a line and column.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "chat/jinja.h"

namespace sparsemla::chat {
namespace {

const std::string kDir = std::string(SPARSEMLA_TEST_DATA) + "/jinja/";

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

const nlohmann::ordered_json& cases() {
  static const nlohmann::ordered_json j = [] {
    const std::string text = read_file(kDir + "cases.json");
    return text.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json::parse(text);
  }();
  return j;
}

std::vector<size_t> case_indices() {
  std::vector<size_t> idx;
  if (cases().contains("cases")) {
    for (size_t i = 0; i < cases()["cases"].size(); ++i) idx.push_back(i);
  }
  return idx;
}

class Jinja2Reference : public testing::TestWithParam<size_t> {};

TEST(Jinja2ReferenceFile, IsPresent) {
  ASSERT_TRUE(cases().contains("cases")) << "missing or empty " << kDir << "cases.json";
  EXPECT_GT(cases()["cases"].size(), 300u);
}

TEST_P(Jinja2Reference, MatchesJinja2) {
  const auto& c = cases()["cases"][GetParam()];
  const std::string source = c.contains("template_file")
                                 ? read_file(kDir + c["template_file"].get<std::string>() + ".jinja")
                                 : c["template"].get<std::string>();
  ASSERT_FALSE(source.empty());
  TemplateOptions options;
  options.trim_blocks = c.value("trim_blocks", true);
  options.lstrip_blocks = c.value("lstrip_blocks", true);
  const nlohmann::ordered_json& context = cases()["contexts"][c["context_ref"].get<std::string>()];

  if (!c.contains("error")) {
    try {
      const Template t = Template::parse(source, options);
      EXPECT_EQ(t.render(context), c["expected"].get<std::string>());
    } catch (const TemplateError& e) {
      FAIL() << "jinja2 rendered " << c["expected"].dump() << " but this failed: " << e.what();
    }
    return;
  }

  const auto& expected = c["error"];
  const std::string jinja2_error = expected["type"].get<std::string>() + ": " + expected["message"].get<std::string>();
  std::string stage = "parse";
  try {
    const Template t = Template::parse(source, options);
    stage = "render";
    const std::string out = t.render(context);
    FAIL() << "rendered " << nlohmann::json(out).dump() << " but jinja2 raised " << jinja2_error;
  } catch (const TemplateError& e) {
    if (!c.value("any_stage", false)) {
      EXPECT_EQ(stage, expected["stage"].get<std::string>()) << e.what() << "\njinja2: " << jinja2_error;
    }
    EXPECT_GT(e.line, 0) << e.what();
    EXPECT_GT(e.column, 0) << e.what();
    if (expected["line"].is_number()) {
      EXPECT_EQ(e.line, expected["line"].get<int>()) << e.what() << "\njinja2: " << jinja2_error;
    }
    if (c.contains("error_contains")) {
      EXPECT_THAT(e.what(), testing::HasSubstr(c["error_contains"].get<std::string>())) << "jinja2: " << jinja2_error;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, Jinja2Reference, testing::ValuesIn(case_indices()),
                         [](const testing::TestParamInfo<size_t>& info) {
                           return cases()["cases"][info.param]["name"].get<std::string>();
                         });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(Jinja2Reference);

}  // namespace
}  // namespace sparsemla::chat
