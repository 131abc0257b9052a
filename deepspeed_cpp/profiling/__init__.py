"""``deepspeed_cpp.profiling``: the flops profiler (``flops_profiler``), DeepSpeed's module path."""
