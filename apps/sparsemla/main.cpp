// sparsemla: run, serve and inspect sparse-attention MLA models from GGUF files.
#include <cstdio>
#include <vector>

#include "commands.h"
#include "util/error.h"

int main(int argc, char** argv) {
  CLI::App app{"sparsemla: inference engine for sparse-attention MLA models (GLM-5, DeepSeek-V3.2) from GGUF"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "sparsemla 0.1.0");
  std::vector<std::pair<CLI::App*, sparsemla::app::Runner>> commands;
  auto add = [&](sparsemla::app::Runner (*make)(CLI::App&)) {
    const size_t before = app.get_subcommands({}).size();
    sparsemla::app::Runner r = make(app);
    commands.emplace_back(app.get_subcommands({})[before], std::move(r));
  };
  add(sparsemla::app::add_inspect);
  add(sparsemla::app::add_devices);
  add(sparsemla::app::add_tokenize);
  add(sparsemla::app::add_detokenize);
  add(sparsemla::app::add_logits);
  add(sparsemla::app::add_run);
  add(sparsemla::app::add_bench);
  add(sparsemla::app::add_make_model);
  add(sparsemla::app::add_write_gguf);
  add(sparsemla::app::add_serve);
  add(sparsemla::app::add_ppl);
  add(sparsemla::app::add_worker);

  CLI11_PARSE(app, argc, argv);
  try {
    for (auto& [cmd, run] : commands)
      if (cmd->parsed()) return run();
  } catch (const sparsemla::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "error: out of memory\n");
    return 1;
  }
  return 0;
}
