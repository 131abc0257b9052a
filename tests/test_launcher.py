"""The launcher: the torchrun command it builds, its refusals, and real launches on loopback."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from launch_helpers import free_port, launch_env

from deepspeed_cpp.accelerator import CPUAccelerator, real_accelerator, set_accelerator
from deepspeed_cpp.launcher import build_torchrun_command, parse_launch_args
from deepspeed_cpp.launcher.hostfile import HostfileError, describe_hostfile, read_hostfile
from deepspeed_cpp.launcher.local_rank_trampoline import deepspeed_launcher_env, worker_command
from deepspeed_cpp.launcher.torchrun_command import TORCHRUN, TRAMPOLINE

PYTHON = sys.executable
LAUNCH_TIMEOUT = 120


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('never run')\n")
    return str(path)


@pytest.fixture
def cpu_accelerator():
    saved = real_accelerator._accelerator
    set_accelerator(CPUAccelerator())
    yield
    set_accelerator(saved)


# ---- the command line handed to torchrun ---------------------------------------------------


def torchrun_prefix(nproc, nnodes=1, node_rank=0, addr="127.0.0.1", port=29500):
    return [
        PYTHON, str(TORCHRUN),
        f"--nproc_per_node={nproc}", f"--nnodes={nnodes}", f"--node_rank={node_rank}",
        f"--master_addr={addr}", f"--master_port={port}",
        "--no_python", PYTHON, str(TRAMPOLINE),
    ]  # fmt: skip


def test_command_single_node(script):
    args = parse_launch_args(["--num_gpus", "2", script, "--deepspeed", "--lr", "0.1"])
    assert build_torchrun_command(args) == torchrun_prefix(2) + [
        "python", "local_rank", script, "--deepspeed", "--lr", "0.1",
    ]  # fmt: skip


def test_command_multi_node_every_flag(script):
    argv = ["--num_procs", "3", "--num_nodes", "4", "--node_rank", "2", "--master_addr",
            "10.1.2.3", "--master_port", "1234", script]  # fmt: skip
    assert build_torchrun_command(parse_launch_args(argv)) == torchrun_prefix(
        3, nnodes=4, node_rank=2, addr="10.1.2.3", port=1234
    ) + ["python", "local_rank", script]


def test_command_num_accelerators_alias_and_module_mode():
    args = parse_launch_args(["--num_accelerators", "5", "--module", "pkg.train", "-x", "1"])
    assert build_torchrun_command(args) == torchrun_prefix(5) + [
        "module", "local_rank", "pkg.train", "-x", "1",
    ]  # fmt: skip


def test_command_executable_without_local_rank():
    args = parse_launch_args(["--num_gpus", "1", "--no_python", "--no_local_rank", "echo", "hi"])
    assert build_torchrun_command(args) == torchrun_prefix(1) + [
        "exec", "no_local_rank", "echo", "hi",
    ]  # fmt: skip


def test_script_arguments_that_look_like_launcher_flags_pass_through(script):
    user = ["--num_gpus", "8", "--master_port", "1", "--include", "x", "--hostfile", "h"]
    args = parse_launch_args(["--num_gpus", "2", script, *user])
    command = build_torchrun_command(args)
    assert command[-len(user) - 1 :] == [script, *user]
    assert "--nproc_per_node=2" in command and "--master_port=29500" in command


def test_default_process_count_is_the_device_count(script, cpu_accelerator, monkeypatch):
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert parse_launch_args([script]).num_procs == 1


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--include", "localhost:0,1"], "--include localhost:0,1: not supported"),
        (["--exclude", "worker-1"], "--exclude worker-1: not supported"),
        (["--launcher", "pdsh"], "--launcher pdsh: not supported"),
        (["--force_multi"], "--force_multi: not supported"),
        (["--num_gpus", "0"], "--num_gpus/--num_procs is 0; expected at least 1"),
        (["--num_nodes", "0"], "--num_nodes is 0; expected at least 1"),
        (["--num_nodes", "2", "--node_rank", "2"], "--node_rank is 2; expected 0 <= node_rank"),
        (["--node_rank", "-1"], "--node_rank is -1"),
        (["--master_port", "70000"], "--master_port is 70000; expected a port in 1..65535"),
        (["--module", "--no_python"], "--module and --no_python exclude each other"),
        (["--num_gpu", "2"], "unrecognized arguments: --num_gpu"),  # no abbreviations
    ],
)
def test_bad_flags_are_refused_by_name(flags, message, script, capsys):
    # With --num_gpus, -i/-e raise DeepSpeed's ValueError first (tests/test_deepspeed_names.py).
    count = [] if flags[0] in ("--include", "--exclude") else ["--num_gpus", "1"]
    with pytest.raises(SystemExit) as exit_info:
        parse_launch_args([*count, *flags, script])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_script_is_named(tmp_path, capsys):
    missing = str(tmp_path / "nope.py")
    with pytest.raises(SystemExit):
        parse_launch_args(["--num_gpus", "1", missing])
    assert f"user_script {missing!r} is not a file" in capsys.readouterr().err


# ---- hostfiles -----------------------------------------------------------------------------


def test_hostfile_is_read_and_described(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\nworker-0 slots=4\n\nworker-1  slots=2  # small one\n")
    hosts = read_hostfile(hostfile)
    assert [(h.host, h.slots) for h in hosts] == [("worker-0", 4), ("worker-1", 2)]
    lines = describe_hostfile(hostfile, hosts, num_nodes=1, procs_per_node=4, master_port=6000)
    assert "2 host(s): worker-0 (slots=4), worker-1 (slots=2)" in lines[0]
    assert "--num_nodes 2 --node_rank <0..1> --master_addr worker-0 --master_port 6000" in lines[1]
    assert any("--num_nodes is 1 but the hostfile lists 2 hosts" in line for line in lines)
    assert any("slots=[2]" in line for line in lines)


@pytest.mark.parametrize(
    "text, message",
    [
        ("worker-0 slots=4\nworker-1\n", "line 2 is 'worker-1'; expected 'hostname slots=N'"),
        ("worker-0 slots=four\n", "line 1 is 'worker-0 slots=four'"),
        ("worker-0 slots=0\n", "line 1: slots=0 for 'worker-0'; expected at least 1"),
        ("a slots=1\nb slots=1\na slots=2\n", "line 3: host 'a' already listed on line 1"),
        ("# nothing\n\n", "lists no hosts"),
    ],
)
def test_bad_hostfile_lines_are_named(tmp_path, text, message):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(text)
    with pytest.raises(HostfileError, match=message.replace("[", r"\[").replace("(", r"\(")):
        read_hostfile(hostfile)


def test_missing_hostfile_is_named(tmp_path):
    with pytest.raises(HostfileError, match="cannot be read"):
        read_hostfile(tmp_path / "absent")


# ---- the trampoline each worker starts as --------------------------------------------------


def test_worker_command_modes():
    env = {"LOCAL_RANK": "3"}
    assert worker_command(["python", "local_rank", "t.py", "-a", "1"], env) == [
        PYTHON, "-u", "t.py", "--local_rank=3", "-a", "1",
    ]  # fmt: skip
    assert worker_command(["module", "local_rank", "pkg.t"], env) == [
        PYTHON, "-u", "-m", "pkg.t", "--local_rank=3",
    ]  # fmt: skip
    assert worker_command(["exec", "no_local_rank", "echo", "x"], env) == ["echo", "x"]


def test_deepspeed_launcher_variables():
    env = deepspeed_launcher_env(
        {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "6", "GROUP_RANK": "1", "LOCAL_RANK": "0"}
    )
    assert (env["LOCAL_SIZE"], env["CROSS_RANK"], env["CROSS_SIZE"]) == ("2", "1", "3")


def test_trampoline_execs_with_local_rank_and_refuses_without_it():
    run = subprocess.run(
        [PYTHON, str(TRAMPOLINE), "exec", "local_rank", "echo", "a", "b"],
        env=dict(os.environ, LOCAL_RANK="3"), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["--local_rank=3", "a", "b"]
    env = dict(os.environ)
    env.pop("LOCAL_RANK", None)
    run = subprocess.run(
        [PYTHON, str(TRAMPOLINE), "python", "local_rank", "x.py"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2
    assert "LOCAL_RANK is None" in run.stderr
    run = subprocess.run(
        [PYTHON, str(TRAMPOLINE), "java", "local_rank", "x.py"],
        env=dict(os.environ, LOCAL_RANK="0"), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2 and "MODE is 'java'" in run.stderr


def test_launcher_start_imports_neither_torch_nor_the_engine():
    # The launcher parses flags and execs torchrun, which imports torch itself: importing it
    # here too would cost every launch a second torch import.
    probe = (
        "import sys\n"
        "import deepspeed_cpp.launcher.__main__\n"
        "print([m for m in sys.modules if m == 'torch' or m.startswith(('deepspeed_cpp.comm', "
        "'deepspeed_cpp.ops', 'deepspeed_cpp.optim', 'deepspeed_cpp.runtime'))])\n"
    )
    run = subprocess.run([PYTHON, "-c", probe], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", run.stdout


def test_package_attributes_load_on_first_touch():
    import deepspeed_cpp
    import deepspeed_cpp.comm.distributed
    import deepspeed_cpp.runtime.initialize
    import deepspeed_cpp.runtime.zero.partition_parameters

    assert deepspeed_cpp.init_distributed is deepspeed_cpp.comm.distributed.init_distributed
    assert deepspeed_cpp.initialize is deepspeed_cpp.runtime.initialize.initialize
    assert deepspeed_cpp.zero.Init is deepspeed_cpp.runtime.zero.partition_parameters.Init
    assert callable(deepspeed_cpp.ops.cpu_adam_step)
    assert issubclass(deepspeed_cpp.optim.FusedAdam, torch.optim.Optimizer)
    namespace = {}
    exec("from deepspeed_cpp import *", namespace)
    assert set(deepspeed_cpp.__all__) <= set(namespace)
    assert {"comm", "ops", "optim", "initialize", "zero", "moe"} <= set(dir(deepspeed_cpp))
    with pytest.raises(AttributeError, match="no attribute 'not_a_part'"):
        deepspeed_cpp.not_a_part  # noqa: B018 - the attribute access is the test


# ---- real launches on loopback -------------------------------------------------------------

PROBE = textwrap.dedent(
    """
    import argparse, json, os, sys

    import torch
    import torch.distributed as dist

    from deepspeed_cpp.accelerator import get_accelerator

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser.add_argument("words", nargs="*")
    args = parser.parse_args()
    dist.init_process_group(get_accelerator().communication_backend_name())
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    names = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE"]
    record = {name: os.environ.get(name) for name in names}
    record.update(argv=sys.argv[1:], local_rank_arg=args.local_rank, all_reduce=total.item(),
                  backend=dist.get_backend(), words=args.words)
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as handle:
        json.dump(record, handle)
    dist.destroy_process_group()
    """
)


def read_records(directory, count):
    records = [json.loads((directory / f"rank{r}.json").read_text()) for r in range(count)]
    return records


def test_two_process_launch_on_loopback(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    port = free_port()
    run = subprocess.run(
        [PYTHON, "-m", "deepspeed_cpp.launcher", "--num_procs", "2", "--master_port", str(port),
         "--hostfile", str(hostfile), str(probe), "--out", str(tmp_path), "alpha", "beta"],
        env=launch_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "hostfile" in run.stderr and "localhost (slots=2)" in run.stderr
    for rank, record in enumerate(read_records(tmp_path, 2)):
        assert record["RANK"] == str(rank) and record["LOCAL_RANK"] == str(rank)
        assert record["WORLD_SIZE"] == "2" and record["LOCAL_SIZE"] == "2"
        assert record["CROSS_RANK"] == "0" and record["CROSS_SIZE"] == "1"
        # DeepSpeed's order: --local_rank right after the script, then the script's arguments.
        assert record["argv"] == [f"--local_rank={rank}", "--out", str(tmp_path), "alpha", "beta"]
        assert record["local_rank_arg"] == rank
        assert record["backend"] == "gloo"
        assert record["all_reduce"] == 3.0


FAILING_WORKER = textwrap.dedent(
    """
    import os, signal, sys, time

    if os.environ["RANK"] == sys.argv[2]:
        how = sys.argv[3]
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(int(how))
    time.sleep(60)  # the other worker: stopped by torchrun once the first one failed
    """
)


@pytest.mark.parametrize(("failing_rank", "how", "status", "said"), [
    (1, "3", 3, "exited with status 3"),
    (0, "kill", 128 + 9, "was killed by signal 9 (SIGKILL)"),
])  # fmt: skip
def test_launch_exits_with_the_first_failing_workers_status(
    tmp_path, failing_rank, how, status, said
):
    worker = tmp_path / "worker.py"
    worker.write_text(FAILING_WORKER)
    run = subprocess.run(
        [PYTHON, "-m", "deepspeed_cpp.launcher", "--num_procs", "2", "--master_port",
         str(free_port()), str(worker), str(failing_rank), how],
        env=launch_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT,
    )  # fmt: skip
    assert run.returncode == status, run.stdout + run.stderr
    named = [line for line in run.stderr.splitlines() if line.startswith("deepspeed-cpp: worker")]
    assert len(named) == 1, run.stderr
    assert named == [
        f"deepspeed-cpp: worker rank {failing_rank} (local rank {failing_rank}, pid "
        + named[0].split("pid ", 1)[1].split(")")[0]
        + f") {said}, the first worker to fail; the launch exits with status {status}"
    ], run.stderr
    assert "Root Cause (first observed failure)" in run.stderr  # torchrun's own summary


def test_module_launch_without_local_rank(tmp_path):
    (tmp_path / "probe_module.py").write_text(PROBE)
    run = subprocess.run(
        [PYTHON, "-m", "deepspeed_cpp.launcher", "--num_gpus", "2", "--master_port",
         str(free_port()), "--module", "--no_local_rank", "probe_module", "--out", str(tmp_path)],
        env=launch_env(PYTHONPATH=str(tmp_path)), capture_output=True, text=True,
        timeout=LAUNCH_TIMEOUT,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    for rank, record in enumerate(read_records(tmp_path, 2)):
        assert record["argv"] == ["--out", str(tmp_path)]
        assert record["local_rank_arg"] == -1 and record["LOCAL_RANK"] == str(rank)
        assert record["all_reduce"] == 3.0


def launch_two_nodes(script, script_args, tmp_path):
    """Two launcher invocations, ``--num_nodes 2``, one process each, meeting on loopback.

    The master port is picked free but released before torchrun binds it, so another process
    can take it in between; a failed rendezvous is retried once on a fresh port.
    """
    try:
        return _launch_two_nodes_once(script, script_args)
    except (AssertionError, subprocess.TimeoutExpired) as first_failure:
        print(f"two-node launch failed once, retrying on a new port: {first_failure}")
        return _launch_two_nodes_once(script, script_args)


def _launch_two_nodes_once(script, script_args):
    port = free_port()
    nodes = [
        subprocess.Popen(
            [
                PYTHON,
                "-m",
                "deepspeed_cpp.launcher",
                "--num_nodes",
                "2",
                "--node_rank",
                str(node),
                "--num_procs",
                "1",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                str(script),
                *script_args,
            ],
            env=launch_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for node in range(2)
    ]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=LAUNCH_TIMEOUT)[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output
    return outputs


def test_two_nodes_on_loopback_all_reduce(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    launch_two_nodes(probe, ["--out", str(tmp_path)], tmp_path)
    for rank, record in enumerate(read_records(tmp_path, 2)):
        assert record["RANK"] == str(rank) and record["WORLD_SIZE"] == "2"
        assert record["LOCAL_RANK"] == "0" and record["local_rank_arg"] == 0
        assert record["CROSS_RANK"] == str(rank) and record["CROSS_SIZE"] == "2"
        assert record["LOCAL_SIZE"] == "1"
        assert record["all_reduce"] == 3.0


ZERO2_TRAIN = textwrap.dedent(
    """
    import argparse, json, os

    import torch

    import deepspeed_cpp as deepspeed

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(13, 29), torch.nn.Tanh(), torch.nn.Linear(29, 7))
    config = {
        "train_micro_batch_size_per_gpu": 5,
        "gradient_clipping": 0.0,  # the reference below does not clip
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 100},
    }
    engine, _, _, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), config=config
    )
    data = torch.Generator().manual_seed(99)
    rank = engine.global_rank
    for _ in range(4):
        inputs = torch.randn(10, 13, generator=data)
        targets = torch.randn(10, 7, generator=data)
        mine = slice(5 * rank, 5 * rank + 5)
        loss = torch.nn.functional.mse_loss(engine(inputs[mine]), targets[mine])
        engine.backward(loss)
        engine.step()
    parameters = [p.detach().tolist() for p in engine.module.parameters()]
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as handle:
        json.dump({"world_size": engine.world_size, "parameters": parameters}, handle)
    """
)


def test_two_nodes_on_loopback_train_zero2(tmp_path):
    script = tmp_path / "train_zero2.py"
    script.write_text(ZERO2_TRAIN)
    launch_two_nodes(script, ["--out", str(tmp_path)], tmp_path)
    # Reference: one process, plain torch Adam on the whole global batch of 10. The mean of the
    # two ranks' mean losses over 5 samples each has the same gradient.
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(13, 29), torch.nn.Tanh(), torch.nn.Linear(29, 7))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(99)
    for _ in range(4):
        inputs, targets = torch.randn(10, 13, generator=data), torch.randn(10, 7, generator=data)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    expected = [p.detach() for p in model.parameters()]
    records = read_records(tmp_path, 2)
    assert records[0]["parameters"] == records[1]["parameters"], "the two nodes diverged"
    for record in records:
        assert record["world_size"] == 2
        for got, want in zip(record["parameters"], expected):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)
