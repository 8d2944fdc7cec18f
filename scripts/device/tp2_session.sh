# One call on two GPUs: every GPU test (suites in separate processes; the NCCL ones last, they need
# the second GPU), then the GLM-5-width models (2 and 3 layers: their difference is one MoE layer) on
# one GPU (int8 activations on and off) and split over both (NCCL, in one process and in two).
mkdir -p /tmp/b && tar -xJf .devbin/packme/p.tar.xz -C /tmp/b && export BIN=/tmp/b LIBS=/tmp/b/lib
BENCH=0 FILTER='Cuda*:*Cuda*:Gpu*:*Gpu*:MultiProcess*:-*Nccl* *Nccl*' TEST_TIMEOUT=240 TAILN=30 bash scripts/device/gpu_model_checks.sh
. scripts/device/env.sh
for L in 2 3; do $BIN/sparsemla make-model --preset glm5-width --layers $L --type q4_k_m --zeros -o /tmp/g$L.gguf >/dev/null; done
b() { echo "== $1"; shift; timeout 120 $BIN/sparsemla bench --device cuda --gen 32 "$@" 2>&1 | grep -E "all-reduce|^ +[0-9]|error"; }
for L in 2 3; do  # the 3-layer model minus the 2-layer one: one MoE layer
  b "$L layers, one GPU" -m /tmp/g$L.gguf --prompt 1024 --batch 1,8,32
  b "$L layers, one GPU, int8 activations" -m /tmp/g$L.gguf --int8-activations --prompt 1024 --batch 1,8,32
  b "$L layers, TP2 NCCL, one process" -m /tmp/g$L.gguf --tensor-parallel 2 --prompt 1024 --batch 1,8,32
done
$BIN/sparsemla worker -m /tmp/g2.gguf --tensor-parallel 2 --tp-rank 1 --tp-master 127.0.0.1:29555 --gpu 1 >"$OUT/worker.log" 2>&1 &
b "2 layers, TP2 NCCL, two processes" -m /tmp/g2.gguf --tensor-parallel 2 --tp-master 127.0.0.1:29555 --prompt 1024 --batch 1,8,32
wait
b "2 layers, one GPU, long context (int8 activations)" -m /tmp/g2.gguf --int8-activations --prompt 4096,131072
b "3 layers, TP2 at 128K: the indexer head split's score all-reduce" -m /tmp/g3.gguf --tensor-parallel 2 --prompt 131072 --gen 16
