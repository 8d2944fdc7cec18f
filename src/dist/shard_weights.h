// One rank's weights under a ShardPlan: views into the whole model's tensors (still the file's
// mapping, nothing copied but the small norm vectors), and the check that every view is exactly the
// slice the plan gives that rank. The check is what stops a sharding slip — say attn_k_b rows of
// the wrong head — from producing fluent-looking garbage.
#pragma once
#include "dist/shard_plan.h"
#include "model/hparams.h"
#include "model/weights.h"

namespace sparsemla::dist {

// Rank `rank`'s views of the main layers' matrices (next-n layers are not run, so not bound), then
// verify_shard on them. Throws Error when the plan and the weights disagree.
model::ModelWeights bind_shard(const model::ModelWeights& full, const model::HParams& hp, const ShardPlan& plan,
                               int rank);

// Every matrix of `shard` must be the plan's slice of the same matrix of `full`: same type, same
// shape, same place. Otherwise throws an Error naming the tensor, the rank, the slice the plan
// expects and the one found.
void verify_shard(const model::ModelWeights& full, const model::ModelWeights& shard, const model::HParams& hp,
                  const ShardPlan& plan, int rank);

}  // namespace sparsemla::dist
