# Two GPUs: the NCCL tests and the GLM-5-width model split over both (threads, then processes).
mkdir -p /tmp/b && tar -xJf .devbin/packme/p.tar.xz -C /tmp/b && export BIN=/tmp/b LIBS=/tmp/b/lib
BENCH=0 FILTER='GpuTensorParallelNccl*:*NcclCommunicator*' TEST_TIMEOUT=150 TAILN=12 bash scripts/device/gpu_model_checks.sh
. scripts/device/env.sh
$BIN/sparsemla make-model --preset glm5-width --layers 2 --type q4_k_m --zeros -o /tmp/g2.gguf >/dev/null
B="--prompt 1024 --gen 32 --batch 1,8,32"
echo "== TP2 threads NCCL"; timeout 120 $BIN/sparsemla bench -m /tmp/g2.gguf --device cuda --tensor-parallel 2 $B 2>&1 | grep -E "decode|all-reduce|^ +[0-9]|error"; echo "exit ${PIPESTATUS[0]}"
echo "== TP2 processes NCCL"; ( timeout 120 $BIN/sparsemla worker -m /tmp/g2.gguf --tensor-parallel 2 --tp-rank 1 --tp-master 127.0.0.1:29555 --gpu 1 > $OUT/worker.log 2>&1; echo "worker exit $?" >> $OUT/worker.log ) &
timeout 120 $BIN/sparsemla bench -m /tmp/g2.gguf --device cuda --tensor-parallel 2 --tp-master 127.0.0.1:29555 $B 2>&1 | grep -E "decode|all-reduce|^ +[0-9]|error"; echo "exit ${PIPESTATUS[0]}"
wait; tail -2 $OUT/worker.log
