"""get_accelerator(): the device interface DeepSpeed scripts call, on the CPU (and CUDA names)."""

import time

import pytest
import torch

from deepspeed_cpp.accelerator import (
    CPUAccelerator,
    CUDAAccelerator,
    DeepSpeedAccelerator,
    get_accelerator,
    real_accelerator,
    set_accelerator,
)
from deepspeed_cpp.ops.op_builder import CPUAdamBuilder


@pytest.fixture(autouse=True)
def _fresh_choice(monkeypatch):
    """Each test chooses the accelerator again, and leaves the process as it found it."""
    saved = real_accelerator._accelerator
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    set_accelerator(None)
    yield
    set_accelerator(saved)


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/self/status")


# ---- choosing ------------------------------------------------------------------------------


def test_automatic_choice_follows_cuda_availability():
    expected = CUDAAccelerator if torch.cuda.is_available() else CPUAccelerator
    accelerator = get_accelerator()
    assert type(accelerator) is expected
    assert get_accelerator() is accelerator, "the choice is made once per process"


def test_ds_accelerator_forces_cpu(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert type(get_accelerator()) is CPUAccelerator


def test_ds_accelerator_unknown_value_is_named(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "tpu")
    with pytest.raises(ValueError, match=r"DS_ACCELERATOR='tpu'.*\['cpu', 'cuda'\]"):
        get_accelerator()


def test_ds_accelerator_cuda_without_a_gpu_is_refused(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    if torch.cuda.is_available():
        assert type(get_accelerator()) is CUDAAccelerator
    else:
        with pytest.raises(RuntimeError, match=r"DS_ACCELERATOR='cuda'.*is_available\(\) is False"):
            get_accelerator()


def test_set_accelerator_replaces_and_checks_its_argument():
    mine = CPUAccelerator()
    set_accelerator(mine)
    assert get_accelerator() is mine
    with pytest.raises(TypeError, match="expected a DeepSpeedAccelerator or None, got str"):
        set_accelerator("cpu")


def test_every_interface_method_is_implemented():
    # Instantiation fails if any abstract method is left out; both kinds must be complete.
    for kind in (CPUAccelerator, CUDAAccelerator):
        assert isinstance(kind(), DeepSpeedAccelerator)
        assert not kind.__abstractmethods__


# ---- CPU -----------------------------------------------------------------------------------


def test_cpu_names_and_backend(monkeypatch):
    cpu = CPUAccelerator()
    assert cpu.is_available()
    assert cpu.device_name() == "cpu"
    assert cpu.device_name(3) == "cpu"  # every local rank shares the host
    assert cpu.current_device_name() == "cpu"
    assert cpu.communication_backend_name() == "gloo"
    assert cpu._name == "cpu"
    assert torch.ones(2, device=cpu.device_name(1)).device.type == "cpu"
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert cpu.current_device() == 0
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert cpu.current_device() == 5
    cpu.set_device(5)  # accepted, nothing to select
    with cpu.device(5):
        pass


def test_cpu_device_count_is_the_local_process_count(monkeypatch):
    cpu = CPUAccelerator()
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert cpu.device_count() == 1
    monkeypatch.setenv("LOCAL_SIZE", "3")
    assert cpu.device_count() == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "7")
    assert cpu.device_count() == 7


def test_cpu_dtypes():
    cpu = CPUAccelerator()
    assert cpu.is_bf16_supported() is True
    # DeepSpeed's CPU accelerator: fp16 where oneDNN has fp16 kernels for this CPU.
    fp16 = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    assert cpu.is_fp16_supported() is fp16
    expected = [torch.float32, torch.bfloat16] + ([torch.float16] if fp16 else [])
    assert cpu.supported_dtypes() == expected


def test_cpu_rng_matches_torch_and_round_trips():
    cpu = CPUAccelerator()
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    cpu.manual_seed(seed)
    ours = torch.randn(17)
    torch.manual_seed(seed)
    assert torch.equal(ours, torch.randn(17))
    cpu.manual_seed_all(seed + 1)
    assert cpu.initial_seed() == seed + 1
    state = cpu.get_rng_state()
    first = torch.rand(13)
    cpu.set_rng_state(state)
    assert torch.equal(first, torch.rand(13))
    assert cpu.default_generator(0) is torch.default_generator
    assert cpu.random() is torch.random


def test_cpu_streams_are_ordered_no_ops():
    cpu = CPUAccelerator()
    stream = cpu.Stream()
    values = torch.arange(5.0)
    with cpu.stream(stream):
        doubled = values * 2
    stream.synchronize()
    stream.wait_stream(cpu.current_stream())
    assert torch.equal(doubled, torch.arange(5.0) * 2)
    assert cpu.current_stream() is cpu.default_stream()
    assert stream.query() and stream.record_event().query()
    cpu.synchronize()
    assert cpu.is_synchronized_device()


def test_cpu_event_timing_measures_host_time():
    cpu = CPUAccelerator()
    start, end = cpu.Event(enable_timing=True), cpu.Event(enable_timing=True)
    start.record()
    wall = time.perf_counter()
    time.sleep(0.03)
    wall = (time.perf_counter() - wall) * 1000
    end.record()
    elapsed = start.elapsed_time(end)
    assert wall <= elapsed < wall + 50, (wall, elapsed)
    with pytest.raises(RuntimeError, match="end_event was created with enable_timing=False"):
        start.elapsed_time(cpu.Event())
    with pytest.raises(RuntimeError, match="self was never recorded"):
        cpu.Event(enable_timing=True).elapsed_time(end)


def test_cpu_memory_figures_follow_the_kernel():
    cpu = CPUAccelerator()
    cpu.reset_peak_memory_stats()
    # Against the kernel's own count of this process's resident memory.
    reported = cpu.memory_allocated()
    kernel = _proc_status_kib("VmRSS") * 1024
    assert abs(reported - kernel) < 16 * 2**20, (reported, kernel)
    before = cpu.memory_allocated()
    block = torch.ones(48 * 2**20 // 4)  # 48 MiB, written, so resident
    grown = cpu.memory_allocated() - before
    assert 44 * 2**20 <= grown <= 64 * 2**20, grown
    peak = cpu.max_memory_allocated()
    del block
    assert peak >= before + 44 * 2**20
    assert cpu.max_memory_allocated() >= peak, "a peak never decreases until reset"
    stats = cpu.memory_stats()
    assert stats["allocated_bytes.all.peak"] >= stats["allocated_bytes.all.current"]
    assert cpu.memory_reserved() > 0 and cpu.max_memory_cached() >= cpu.memory_cached()
    cpu.reset_max_memory_allocated()
    assert cpu.max_memory_allocated() < peak + 16 * 2**20
    with open("/proc/meminfo") as meminfo:
        fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in meminfo}
    assert abs(cpu.total_memory() - fields["MemTotal"]) < 2**30
    assert 0 < cpu.available_memory() <= cpu.total_memory()
    cpu.empty_cache()


def test_cpu_tensor_helpers():
    cpu = CPUAccelerator()
    tensor = torch.randn(9)
    assert cpu.pin_memory(tensor) is tensor
    assert cpu.is_pinned(tensor) is False
    assert cpu.on_accelerator(tensor)
    assert not cpu.on_accelerator(torch.empty(3, device="meta"))
    assert cpu.amp() is torch.cpu.amp
    assert cpu.FloatTensor is torch.FloatTensor and cpu.BFloat16Tensor is torch.BFloat16Tensor
    assert cpu.lazy_call(lambda: 41 + 1) == 42
    cpu.range_push("region")
    cpu.range_pop()
    assert cpu.visible_devices_envs() == []


def test_op_builders_by_deepspeed_class_name():
    cpu = CPUAccelerator()
    assert cpu.get_op_builder("CPUAdamBuilder") is CPUAdamBuilder
    assert isinstance(cpu.create_op_builder("CPUAdamBuilder"), CPUAdamBuilder)
    assert cpu.get_op_builder("NoSuchBuilder") is None
    assert cpu.create_op_builder("NoSuchBuilder") is None
    assert cpu.get_op_builder("ALL_OPS") is None  # a non-builder attribute is not a builder


# ---- CUDA ----------------------------------------------------------------------------------


def test_cuda_names_without_touching_a_device():
    cuda = CUDAAccelerator()
    assert cuda.device_name() == "cuda"
    assert cuda.device_name(0) == "cuda:0" and cuda.device_name(3) == "cuda:3"
    assert cuda.communication_backend_name() == "nccl"
    assert cuda.is_available() == torch.cuda.is_available()
    assert not cuda.on_accelerator(torch.zeros(2))
    assert cuda.visible_devices_envs() == ["CUDA_VISIBLE_DEVICES"]
    env = {}
    cuda.set_visible_devices_envs(env, [2, 5])
    assert env == {"CUDA_VISIBLE_DEVICES": "2,5"}
    if not torch.cuda.is_available():
        assert cuda.is_bf16_supported() is False and cuda.is_fp16_supported() is False
        assert cuda.supported_dtypes() == [torch.float32]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device_calls():
    cuda = CUDAAccelerator()
    cuda.set_device(0)
    assert cuda.current_device() == 0 and cuda.current_device_name() == "cuda:0"
    assert cuda.device_count() == torch.cuda.device_count()
    tensor = torch.randn(1000, device=cuda.device_name(0))
    assert cuda.on_accelerator(tensor)
    cuda.manual_seed(7)
    first = torch.randn(5, device="cuda")
    cuda.manual_seed(7)
    assert torch.equal(first, torch.randn(5, device="cuda"))
    start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
    with cuda.stream(cuda.Stream()):
        start.record()
        (tensor @ tensor).item()
        end.record()
    cuda.synchronize()
    assert start.elapsed_time(end) >= 0
    assert cuda.memory_allocated() >= tensor.numel() * 4
    assert cuda.pin_memory(torch.zeros(4)).is_pinned()
    assert 0 < cuda.available_memory() <= cuda.total_memory()
