"""Fresh prompts on a GPU: varlen flash (bf16, fp16) and cuDNN one prompt at a time (fp16,
TritonConfig.fresh_prefill_cudnn) against float64 causal attention. GPU only."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("flash and cuDNN attention need a GPU", allow_module_level=True)

from nanokv_tools.bench.gpu_profile import check_fresh_prefill  # noqa: E402

from nanokv.kernels import fresh_prefill  # noqa: E402


@pytest.mark.parametrize("dtype,cudnn,tol", [(torch.bfloat16, False, 5e-3), (torch.float16, False, 1e-3),
                                             (torch.float16, True, 1e-3)])
def test_fresh_prefill_matches_float64(dtype: torch.dtype, cudnn: bool, tol: float) -> None:
    err = check_fresh_prefill(torch.device("cuda"), dtype, cudnn)
    assert err < tol
    if cudnn:
        assert fresh_prefill._CUDNN_OK[0]  # cuDNN served (no fallback to flash)
