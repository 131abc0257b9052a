"""deepspeed.runtime.utils.see_memory_usage (issue 30): host and device memory, on demand."""

from __future__ import annotations


def test_see_memory_usage_reports_host_memory(caplog):
    import logging

    from deepspeed_cpp.runtime.utils import see_memory_usage

    assert see_memory_usage("quiet") is None  # only with force, as DeepSpeed
    with caplog.at_level(logging.INFO, logger="deepspeed_cpp"):
        text = see_memory_usage("after forward", force=True)
    assert text.splitlines()[0] == "after forward"
    assert "CPU Virtual Memory:  used = " in text and "process RSS = " in text
    assert "after forward" in caplog.text
