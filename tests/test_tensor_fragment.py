"""DeepSpeed's tensor-fragment API (``deepspeed_cpp.utils.safe_get_full_fp32_param`` & co.) at
ZeRO stages 1, 2 and 3 on a real 2-process gloo group, against torch.optim.AdamW training the
whole global batch in one process (jobs in tensor_fragment_jobs.py)."""

from __future__ import annotations

import pytest
import tensor_fragment_jobs as jobs


@pytest.mark.parametrize(
    "stage, dtype, offload, one_bucket",
    [(1, "fp32", False, False), (2, "fp32", False, False), (3, "fp32", False, False),
     (2, "bf16", False, False), (3, "bf16", False, False), (2, "fp32", True, False),
     (3, "fp32", True, False), (2, "fp32", False, True)],
)  # fmt: skip
def test_fragments_follow_the_reference(pool2, stage, dtype, offload, one_bucket):
    checked = pool2.run(jobs.fragments_match_reference, stage, dtype, offload, one_bucket)
    trained = 4  # first/second weight and bias
    assert checked[0] == {"grads": 3 * trained, "params": 3 * trained, "states": 6 * trained,
                          "locals": 3 * trained}  # fmt: skip


@pytest.mark.parametrize("stage", [1, 3])
def test_errors_name_the_problem(pool2, stage):
    messages = pool2.run(jobs.errors_are_named, stage)[0]
    unmanaged, no_state_yet, unknown_key, step_key, shape, local_shape, frozen, destroyed = messages
    assert "not trained by a live deepspeed_cpp engine" in unmanaged
    assert "no state yet" in no_state_yet
    assert "'momentum_buffer'" in unknown_key and "exp_avg" in unknown_key
    assert "'step'" in step_key
    assert "[6, 13]" in shape and "[5, 13]" in shape
    assert "safe_set_local_fp32_param" in local_shape
    assert "frozen" in frozen
    assert "not trained by a live deepspeed_cpp engine" in destroyed
