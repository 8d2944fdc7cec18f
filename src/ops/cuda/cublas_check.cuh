// SPARSEMLA_CUBLAS_CHECK: a cuBLAS call whose failure throws sparsemla::Error naming the call, the
// place and cuBLAS's status (the cuBLAS users: absorb.cu, prefill_blas.cu).
#pragma once
#include <cublas_v2.h>

#include "util/error.h"

#define SPARSEMLA_CUBLAS_CHECK(call)                                                                          \
  do {                                                                                                        \
    const cublasStatus_t st_ = (call);                                                                        \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                                         \
      ::sparsemla::fail("cuBLAS error in {} ({}:{}): {}", #call, __FILE__, __LINE__, cublasGetStatusString(st_)); \
  } while (0)
