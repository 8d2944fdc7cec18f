// Each subcommand of `sparsemla` registers itself on the CLI11 app; main() runs the chosen one.
#pragma once
#include <CLI/CLI.hpp>

#include <functional>

namespace sparsemla::app {

using Runner = std::function<int()>;

// Adds the subcommand and returns the function that runs it once arguments are parsed.
Runner add_inspect(CLI::App& app);
Runner add_devices(CLI::App& app);
Runner add_tokenize(CLI::App& app);
Runner add_detokenize(CLI::App& app);
Runner add_logits(CLI::App& app);
Runner add_run(CLI::App& app);
Runner add_bench(CLI::App& app);
Runner add_bench_attention(CLI::App& bench);  // `bench attention`, a subcommand of bench
Runner add_make_model(CLI::App& app);
Runner add_write_gguf(CLI::App& app);
Runner add_serve(CLI::App& app);
Runner add_ppl(CLI::App& app);
Runner add_worker(CLI::App& app);

}  // namespace sparsemla::app
