// `sparsemla worker`: rank 1..N-1 of a tensor-parallel group whose rank 0 is another process
// (engine/remote_ranks.h): joins rank 0, loads this rank's shard as rank 0 says, and runs its steps
// until rank 0 stops.
#include <cstdio>

#include "commands.h"
#include "device_options.h"
#include "engine/remote_ranks.h"

namespace sparsemla::app {

Runner add_worker(CLI::App& app) {
  struct Args {
    std::string model;
    int tensor_parallel = 0, rank = 0, gpu = -1, threads = 0;
    DeviceArgs dev;
  };
  auto a = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand(
      "worker", "Run rank R of a tensor-parallel group whose rank 0 is a `run`/`serve`/`bench`/`logits`/`ppl` "
                "started with --tp-master (another process, or another host)");
  cmd->add_option("-m,--model", a->model, "GGUF file (the first of a split set): the same model as rank 0's")->required();
  cmd->add_option("--tensor-parallel", a->tensor_parallel, "ranks in the group (rank 0's --tensor-parallel)")
      ->required()
      ->check(CLI::Range(2, 1024));
  cmd->add_option("--tp-rank", a->rank, "this process's rank, 1..N-1")->required();
  cmd->add_option("--gpu", a->gpu, "the GPU of this rank when rank 0 runs on the GPU (default: rank modulo the GPUs here)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("-t,--threads", a->threads, "CPU threads (default: rank 0's --threads, else all)");
  cmd->add_option("--tp-master", a->dev.tp_master, "rank 0's HOST:PORT (its --tp-master)")->required();
  cmd->add_option("--tp-timeout", a->dev.tp_timeout, "seconds to wait for rank 0, and for each exchange")
      ->check(CLI::PositiveNumber);
  // Everything else (device, cache, attention, precision, transport) is rank 0's to say.
  return [a] {
    engine::WorkerOptions o;
    o.model_path = a->model;
    o.n_ranks = a->tensor_parallel;
    o.procs.rank = a->rank;
    o.procs.master = a->dev.tp_master;
    o.procs.timeout = std::chrono::milliseconds(int64_t(a->dev.tp_timeout * 1000));
    o.gpu = a->gpu;
    o.threads = a->threads;
    o.log = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
    engine::run_worker(o);
    return 0;
  };
}

}  // namespace sparsemla::app
