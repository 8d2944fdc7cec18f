# One call on two GPUs: every GPU test (suites in separate processes; the NCCL ones last, they need
# the second GPU), then the GLM-5-width model's decode on one GPU (int8 activations on and off) and
# split over both (NCCL).
mkdir -p /tmp/b && tar -xJf .devbin/packme/p.tar.xz -C /tmp/b && export BIN=/tmp/b LIBS=/tmp/b/lib
BENCH=0 FILTER='Cuda*:*Cuda*:Gpu*:*Gpu*:MultiProcess*:-*Nccl* *Nccl*' TEST_TIMEOUT=240 TAILN=30 bash scripts/device/gpu_model_checks.sh
. scripts/device/env.sh
$BIN/sparsemla make-model --preset glm5-width --layers 2 --type q4_k_m --zeros -o /tmp/g2.gguf >/dev/null
b() { echo "== $1"; shift; timeout 100 $BIN/sparsemla bench -m /tmp/g2.gguf --device cuda --gen 32 "$@" 2>&1 | grep -E "all-reduce|^ +[0-9]|error"; }
b "one GPU" --prompt 1024 --batch 1,8,32
b "one GPU, int8 activations" --int8-activations --prompt 1024 --batch 1,8
b "one GPU, long context" --prompt 4096,131072
b "TP2 threads NCCL" --tensor-parallel 2 --prompt 1024 --batch 1,8,32
