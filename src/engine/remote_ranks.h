// Tensor parallelism over processes, on one host or several: rank 0 runs the command (run, serve,
// bench, logits, ppl) with --tp-master HOST:PORT, and ranks 1..N-1 run `sparsemla worker` pointed
// at that address. Every rank opens the same GGUF file (its own copy on its own host) and holds
// only its shard (dist/shard_plan.h).
//
//   rank 0:   sparsemla serve -m glm5.gguf --device cuda --tensor-parallel 8 --tp-master 0.0.0.0:29500
//   rank r:   sparsemla worker -m glm5.gguf --tensor-parallel 8 --tp-rank r --tp-master node0:29500 --gpu 0
//
// Start-up: rank 0 listens; the workers connect (dist::TcpBootstrap) and receive rank 0's
// configuration (dist::RankConfig: device, cache format and size, attention mode, precision, and
// the NCCL unique id), so every rank runs as rank 0 was told to. Each loads its shard, then all
// ranks report whether they succeeded (a worker's error, such as a different model file, is
// rank 0's error too, naming the rank), and only then join NCCL.
// Steps: before each forward rank 0 sends the step (the batch with its block tables, or device
// sampling's parameters) over the TCP star; every rank runs it on its shard, the collectives going
// over NCCL (one GPU per rank), or for --tp-transport host through the TCP star itself (host-staged:
// any GPUs, the CPU forward, and the tests on one GPU). Only rank 0 has a scheduler; the workers'
// KV caches follow rank 0's block tables. Rank 0 sends stop when its backend goes away; a worker
// whose rank 0 disappears, or whose step fails, exits with an error, and rank 0's next collective
// fails naming it.
#pragma once
#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "engine/backend.h"

namespace sparsemla::engine {

// Rank 0's side: the backend the command uses, its rank-0 shard local, the others remote. Waits up
// to opts.procs.timeout for the workers to connect.
std::unique_ptr<Backend> make_leader_backend(model::Model& model, const BackendOptions& opts, int32_t kv_blocks,
                                             int32_t block_size, int64_t batch_tokens);

struct WorkerOptions {
  std::string model_path;
  int n_ranks = 0;
  ProcessGroupOptions procs;  // rank (>= 1), master, timeout
  int gpu = -1;               // --device cuda: this rank's GPU (-1: rank modulo the GPUs it sees)
  int threads = 0;            // CPU threads (0: rank 0's choice, else all)
  std::function<void(const std::string&)> log;  // progress lines (stderr in the CLI)
};

// A worker: joins rank 0, loads its shard as rank 0's configuration says, and runs rank 0's steps
// until rank 0 says stop (returns) or goes away or a step fails (throws Error).
void run_worker(const WorkerOptions& o);

}  // namespace sparsemla::engine
