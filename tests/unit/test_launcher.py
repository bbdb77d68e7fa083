"""scripts/launcher.py: the launcher's logic outside bash (rendezvous addresses, torchrun's
arguments, folders, mounts, EFA), without Slurm or torch. Signals and exit codes through real
processes: tests/integration/test_launcher_processes.py."""

from __future__ import annotations

import os
from pathlib import Path

import launch_plan
import launcher
import pytest

REPO = Path(__file__).resolve().parents[2]

SHOW_NODE = """\
NodeName=node1 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 NodeAddr=10.7.0.11 NodeHostName=ip-10-7-0-11 Version=22.05.8
NodeName=node2 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 NodeAddr=10.7.0.12 NodeHostName=ip-10-7-0-12 Version=22.05.8
"""  # noqa: E501


def test_node_addresses_come_from_slurm_nodeaddr() -> None:
    assert launch_plan.parse_node_addrs(SHOW_NODE) == {"node1": "10.7.0.11", "node2": "10.7.0.12"}
    # A NodeAddr that is a name is resolved on the batch host; the node name itself is never
    # what the other nodes are told to connect to when an address is known.
    table = {"gpu-a": ["10.0.0.5"], "gpu-b": ["10.0.0.6"]}
    addrs = launch_plan.resolve_node_addrs(
        ["n1", "n2"], {"n1": "gpu-a", "n2": "gpu-b"}, "n1", resolve=lambda h: table.get(h, [])
    )
    assert addrs == {"n1": "10.0.0.5", "n2": "10.0.0.6"}


def test_a_head_node_resolving_to_loopback_uses_its_address_towards_the_others() -> None:
    """Debian's '127.0.1.1 myhost' line: the head's own name resolves to loopback there."""
    table = {"n1": ["127.0.1.1"], "n2": ["10.0.0.6"]}
    addrs = launch_plan.resolve_node_addrs(
        ["n1", "n2"],
        {},
        "n1",
        resolve=lambda h: table[h],
        source_towards=lambda peer: "10.0.0.5" if peer == "10.0.0.6" else None,
    )
    assert addrs == {"n1": "10.0.0.5", "n2": "10.0.0.6"}
    # Unresolvable here: left to torch on the nodes (it says so if it cannot either).
    assert launch_plan.resolve_node_addrs(["x"], {}, "x", resolve=lambda h: []) == {"x": "x"}


def test_rendezvous_names_the_head_node_and_every_address() -> None:
    def scontrol(*args: str) -> str:
        return {"hostnames": "node1\nnode2\n", "node": SHOW_NODE}[args[1]]

    env = {"SLURM_JOB_NODELIST": "node[1-2]", "SLURMD_NODENAME": "node1"}
    line = launch_plan.rendezvous(env, run=scontrol)
    assert line == "node1 10.7.0.11 node1=10.7.0.11,node2=10.7.0.12"


def node_env(**extra: str) -> dict[str, str]:
    env = {
        "LLAMA_REPO_DIR": "/repo",
        "LLAMA_NNODES": "2",
        "SLURM_JOB_ID": "77",
        "LLAMA_RDZV_ENDPOINT": "10.7.0.11:20077",
        "LLAMA_RDZV_ID": "77",
        "LLAMA_HEAD_NODE": "node1",
        "LLAMA_NODE_ADDRS": "node1=10.7.0.11,node2=10.7.0.12",
    }
    env.update(extra)
    return env


def test_torchrun_on_each_node_meets_at_the_head_address() -> None:
    head, _, line = launcher.torchrun_command(
        node_env(SLURMD_NODENAME="node1", SLURM_NODEID="0"), ["--preset", "tiny"], 8, 96
    )
    other, extra, _ = launcher.torchrun_command(
        node_env(SLURMD_NODENAME="node2", SLURM_NODEID="1"), ["--preset", "tiny"], 8, 96
    )
    common = [
        "torchrun",
        "--nnodes=2",
        "--nproc_per_node=8",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=10.7.0.11:20077",
        "--rdzv_id=77",
    ]
    tail = ["/repo/train.py", "--preset", "tiny"]
    # The head hosts the store by name, not by torch matching its hostname to the address.
    assert head == [*common, "--rdzv_conf=is_host=1", "--local_addr=10.7.0.11", *tail]
    assert other == [*common, "--rdzv_conf=is_host=0", "--local_addr=10.7.0.12", *tail]
    assert "8 GPU(s), 8 workers" in line and "node rank 0/2" in line and "10.7.0.11" in line
    # GPUs: no OMP override; the tokenizer threads split the cores; torchrun ignores USR1/TERM/INT.
    assert extra == {"RAYON_NUM_THREADS": "12", "PET_SIGNALS_TO_HANDLE": "SIGHUP,SIGQUIT"}


def test_gloo_binds_the_interface_holding_the_nodes_address() -> None:
    """Unset, gloo binds what the host name resolves to (maybe 127.0.1.1): the launcher names
    the interface that holds the node's planned address, found on this machine's real ones."""
    local = node_env(SLURMD_NODENAME="node1", LLAMA_NODE_ADDRS="node1=127.0.0.1,node2=10.7.0.12")
    _, extra, _ = launcher.torchrun_command(local, [], 8, 96)
    assert extra["GLOO_SOCKET_IFNAME"] == launcher.interface_of("127.0.0.1") == "lo"
    _, extra, _ = launcher.torchrun_command({**local, "GLOO_SOCKET_IFNAME": "ib0"}, [], 8, 96)
    assert "GLOO_SOCKET_IFNAME" not in extra  # the user's choice is kept
    assert launcher.interface_of("203.0.113.9") is None  # on no interface here: gloo chooses


def test_without_slurm_torchrun_is_standalone_and_cpu_threads_are_shared() -> None:
    env = {"LLAMA_REPO_DIR": "/repo", "LLAMA_NNODES": "1", "NPROC_PER_NODE": "3"}
    argv, extra, line = launcher.torchrun_command(env, [], 0, 8)
    assert argv == [
        "torchrun",
        "--nnodes=1",
        "--nproc_per_node=3",
        "--standalone",
        "/repo/train.py",
    ]
    assert extra["OMP_NUM_THREADS"] == "2" and extra["RAYON_NUM_THREADS"] == "2"
    assert "CPU, 3 workers" in line
    user_set = {**env, "OMP_NUM_THREADS": "1", "RAYON_NUM_THREADS": "4"}
    assert set(launcher.torchrun_command(user_set, [], 0, 8)[1]) == {"PET_SIGNALS_TO_HANDLE"}


def test_the_argument_check_is_told_the_world_the_launch_starts() -> None:
    """Nodes from the plan x workers per node (NPROC_PER_NODE, else one per GPU, else 2 on a
    CPU): what 1.train_llama.sbatch passes as WORLD_SIZE to train.py --validate_only, so
    --sharding_strategy none is refused there, once (test_arguments holds the refusal)."""
    cpu = {"CUDA_VISIBLE_DEVICES": "NoDevFiles"}
    nodes = [("env", "PATH=/bin"), ("env", "LLAMA_NNODES=2")]
    assert launcher.planned_world({**cpu, "NPROC_PER_NODE": "3"}, nodes) == 6
    assert launcher.planned_world({"SLURM_GPUS_ON_NODE": "8"}, nodes) == 16
    assert launcher.planned_world({"CUDA_VISIBLE_DEVICES": "0"}, [("arg", "--fp8=1")]) == 1


def test_a_slurm_job_given_none_of_its_nodes_gpus_is_refused() -> None:
    """On a cluster that hands GPUs out as gres, a job that asked for none sees none (Slurm's
    NoDevFiles) on a node whose driver has 8: refused in one line, not trained on the CPUs."""
    job = {"SLURM_JOB_ID": "7", "CUDA_VISIBLE_DEVICES": "NoDevFiles"}
    nodes = [("env", "LLAMA_NNODES=2")]
    with pytest.raises(
        launcher.UsageError, match="this node has 8 GPUs but the Slurm job was"
    ) as e:
        launcher.planned_world(job, nodes, on_node=lambda: 8)
    assert "submit with sbatch --gpus-per-node=8, or add #SBATCH --gpus-per-node=8" in str(e.value)
    assert launcher.planned_world(job, nodes, on_node=lambda: 0) == 4  # a CPU cluster
    assert launcher.planned_world({**job, "NPROC_PER_NODE": "2"}, nodes, on_node=lambda: 8) == 4
    without_slurm = {"CUDA_VISIBLE_DEVICES": "NoDevFiles"}
    assert launcher.planned_world(without_slurm, nodes, on_node=lambda: 8) == 4


def test_folders_flags_and_the_cleanup_of_a_refused_start(tmp_path: Path) -> None:
    args = ["--output_dir", "a", "--checkpoint_dir=b", "--output_dir=c"]
    assert launch_plan.flag_value(args, "output_dir") == "c"  # the last one wins, as in argparse
    assert launch_plan.flag_value(args, "checkpoint_dir") == "b"
    assert launch_plan.flag_value(args, "seed") is None
    (tmp_path / "runs").mkdir()
    ckpt, out = tmp_path / "runs/r/checkpoints", tmp_path / "runs/r"
    created = launch_plan.make_dirs([str(ckpt), str(out)])
    assert created == [str(ckpt), str(out)] and ckpt.is_dir()
    for path in created:  # the sbatch's `rmdir` of a refused start: deepest first
        os.rmdir(path)
    assert not out.exists() and (tmp_path / "runs").is_dir()  # only what it created
    (tmp_path / "runs/taken").write_text("a file where a folder must go")
    with pytest.raises(launch_plan.UsageError, match=r"cannot create .*/runs/taken \(File exists"):
        launch_plan.make_dirs(
            [str(tmp_path / "runs/new/checkpoints"), str(tmp_path / "runs/taken")]
        )
    assert sorted(os.listdir(tmp_path / "runs")) == ["taken"]  # runs/new went again


def test_a_failed_step_leaves_only_folders_that_hold_something(tmp_path: Path) -> None:
    """After a run refused after start-up, the launch's folders that hold nothing but a free
    run lock go; a lock a live run holds, or any other file, keeps its folder."""
    from model_utils.run import run_lock

    assert launcher.LOCK_FILE == run_lock.LOCK_NAME
    out = tmp_path / "runs/r"
    lock = run_lock.RunLock(out).acquire()
    (out / "checkpoints").mkdir()
    made = [str(out / "checkpoints"), str(out)]
    launcher.remove_unused(made)
    assert sorted(os.listdir(out)) == [".run.lock"]  # held: the run is live
    lock.fd, fd = None, lock.fd
    os.close(fd)  # released without release()'s own clean-up, as a killed rank's
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept/notes.txt").write_text("a user's")
    launcher.remove_unused([*made, str(tmp_path / "kept")])
    assert sorted(os.listdir(tmp_path)) == ["kept", "runs"]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"NPROC_PER_NODE": "0"}, "NPROC_PER_NODE=0 is not a number of workers per node"),
        ({"SLURM_NNODES": "x"}, "SLURM_NNODES=x is not a number of nodes"),
        ({"SLURM_NNODES": "2"}, "SLURM_NNODES=2 asks for 2 nodes outside a Slurm job"),
        ({"SLURM_JOB_ID": "7"}, "SLURM_JOB_ID=7 is set but SLURM_JOB_NODELIST is not"),
    ],
)
def test_bad_settings_are_one_usage_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(launch_plan.UsageError, match=message):
        launch_plan.check_environment(env)
    launch_plan.check_environment(
        {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1", "SLURM_NNODES": "2"}
    )


def test_efa_nodes_get_the_ofi_plugin_or_one_clear_refusal(tmp_path: Path) -> None:
    """Decided inside the container: EFA devices (found by their kernel driver) need the
    aws-ofi-nccl plugin, or NCCL would silently run over TCP."""
    sys_class = tmp_path / "infiniband"
    for dev, driver in (("rdmap16s27", "efa"), ("rdmap32s27", "efa"), ("mlx5_0", "mlx5_core")):
        (tmp_path / "drivers" / driver).mkdir(parents=True, exist_ok=True)
        (sys_class / dev / "device").mkdir(parents=True)
        (sys_class / dev / "device" / "driver").symlink_to(tmp_path / "drivers" / driver)
    devices = launcher.efa_devices(sys_class)
    assert devices == ["rdmap16s27", "rdmap32s27"]
    assert launcher.efa_devices(tmp_path / "absent") == []

    with pytest.raises(launch_plan.UsageError, match="no aws-ofi-nccl plugin .* INSTALL_EFA=1"):
        launcher.network_settings({}, devices, launcher.find_ofi_plugin({}, dirs=()))

    plugin_dir = tmp_path / "ofi" / "lib"
    plugin_dir.mkdir(parents=True)
    (plugin_dir / "libnccl-net-ofi.so").write_bytes(b"")
    env = {"LD_LIBRARY_PATH": "/usr/lib", "FI_PROVIDER": "efa", "NCCL_NET_PLUGIN": "custom"}
    plugin = launcher.find_ofi_plugin(env, dirs=(str(plugin_dir),))
    assert plugin == str(plugin_dir / "libnccl-net-ofi.so")
    extra, line = launcher.network_settings(env, devices, plugin)
    # The user's own NCCL_NET_PLUGIN/FI_PROVIDER stay; the rest is set; the plugin is findable.
    assert extra == {
        "FI_EFA_USE_HUGE_PAGE": "0",
        "LD_LIBRARY_PATH": f"{plugin_dir}:/usr/lib",
    }
    assert "EFA (2 devices)" in line and "NCCL_NET_PLUGIN=custom" in line
    assert launcher.network_settings(env, [], None) == (
        {},
        "network: no EFA device; NCCL chooses (InfiniBand/RoCE if present, else TCP)",
    )


def test_container_mounts_only_the_folders_in_effect(tmp_path: Path) -> None:
    """RUNS_DIR is mounted when it exists; with the user's own --output_dir elsewhere it may
    not, and Pyxis cannot mount a missing folder."""
    env = {"LLAMA_REPO_DIR": "/repo", "RUNS_DIR": str(tmp_path / "runs")}
    assert launch_plan.container_mounts(env, ["/mine/checkpoints", "/mine"]) == (
        "/repo:/repo,/mine/checkpoints:/mine/checkpoints,/mine:/mine"
    )
    (tmp_path / "runs").mkdir()
    assert f"{tmp_path}/runs:{tmp_path}/runs" in launch_plan.container_mounts(env, ["/mine"])


AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
ZEN4 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


def test_a_cpu_without_bf16_units_is_read_from_its_flags(tmp_path: Path) -> None:
    assert not launch_plan.cpu.native_bf16(AVX2_ONLY)
    assert launch_plan.cpu.native_bf16(ZEN4) and launch_plan.cpu.native_bf16(ARM_BF16)
    (tmp_path / "cpuinfo").write_text(AVX2_ONLY)
    assert launch_plan.cpu.cpu_computes_bf16(tmp_path / "cpuinfo") is False
    assert launch_plan.cpu.cpu_computes_bf16(tmp_path / "none") is None  # e.g. macOS


def test_a_bf16_run_on_a_cpu_without_bf16_units_is_told_in_one_line() -> None:
    hint = launch_plan.slow_bf16_hint(["--preset", "tiny"], gpus=0, native_bf16=False)
    assert "no bf16 units" in hint and "--bf16=0 computes in fp32" in hint
    assert "\n" not in hint
    # said only where it applies: fp32 already, bf16 units, a GPU node, an unknown CPU
    assert launch_plan.slow_bf16_hint(["--bf16=0"], gpus=0, native_bf16=False) == ""
    assert launch_plan.slow_bf16_hint([], gpus=0, native_bf16=True) == ""
    assert launch_plan.slow_bf16_hint([], gpus=8, native_bf16=False) == ""
    assert launch_plan.slow_bf16_hint([], gpus=0, native_bf16=None) == ""
