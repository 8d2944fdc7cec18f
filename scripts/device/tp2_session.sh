# One call on two GPUs: every GPU test (the NCCL ones need the second GPU), then the GLM-5-width
# model's decode on one GPU (int8 activations on and off) and split over both (NCCL).
mkdir -p /tmp/b && tar -xJf .devbin/packme/p.tar.xz -C /tmp/b && export BIN=/tmp/b LIBS=/tmp/b/lib
BENCH=0 FILTER='Cuda*:*Cuda*:Gpu*:*Gpu*:MultiProcess*:*Nccl*' TEST_TIMEOUT=200 TAILN=25 bash scripts/device/gpu_model_checks.sh
. scripts/device/env.sh
$BIN/sparsemla make-model --preset glm5-width --layers 2 --type q4_k_m --zeros -o /tmp/g2.gguf >/dev/null
b() { echo "== $1"; shift; timeout 100 $BIN/sparsemla bench -m /tmp/g2.gguf --device cuda --gen 32 "$@" 2>&1 | grep -E "all-reduce|^ +[0-9]|error"; }
b "one GPU" --prompt 1024 --batch 1,8,32
SPARSEMLA_INT8_ACTIVATIONS=0 b "one GPU, fp32 activations" --prompt 1024 --batch 1,8
b "one GPU, long context" --prompt 4096,131072
b "TP2 threads NCCL" --tensor-parallel 2 --prompt 1024 --batch 1,8,32
