"""What 1.train_llama.sbatch asks Python for, where it can be tested: the plan (on the batch
host, scripts/launch_plan.py) and each node's torchrun (here).

Standard library only: on the batch host it runs on whatever `python3` is there (3.8 or newer),
on the nodes on the job's Python (the container's, or the venv's). Subcommands:

  plan N DEFAULTS(N)... ARGS...
            the whole launch, as NUL-separated `key=value` records the sbatch reads (no shell
            is generated): train.py's arguments (arg=), the folders in effect, the mode (train,
            validate, help), variables to export (env=), lines to log (say=), the Pyxis options
            (container=) and the folders this launch created (created=, removed again if the
            argument check refuses the run). Bad settings: one line, exit 2, nothing created.
  node ARGS...
            on every node: torchrun with one worker per GPU, signals forwarded to the workers
  finished CKPT_DIR
            exit 0 when the newest complete checkpoint is at the run's max_steps (asked only
            after a preemption, before a requeue)
  unmade DIR...
            after a failed training step: the folders this launch created (deepest first)
            that the run left holding nothing but its released lock, removed
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import os
import platform
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from launch_plan import UsageError, cpu, launch_records, published, slow_bf16_hint

# The signals that ask train.py for a checkpoint at its next logging step, then an exit.
FORWARDED = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
RESEND_EVERY_S = 5.0
#: After a worker failed, how long torchrun's stop of the others may take before they are
#: killed: a worker whose peer is gone can finish no collective (nor a save), and a stopped one
#: never acts on torchrun's SIGTERM, which would cost torchrun's 30 s grace.
TEARDOWN_S = 5.0
#: train.py's exit codes that its own line explains (a refusal, a hang's stacks): the launch
#: exits with it, without torchrun's traceback and box.
OWN_LINE_CODES = (2, 4)
#: What the launcher's death sends torchrun (one of PET_SIGNALS_TO_HANDLE): torchrun then ends
#: its workers, so no rank trains on headless, holding the run folder.
PARENT_DEATH_SIGNAL = signal.SIGHUP
LOCK_FILE = ".run.lock"  # model_utils/run/run_lock.py's LOCK_NAME


# ---- The per-node part: torchrun with one worker per GPU


def detect_gpus(env: Mapping[str, str], nvidia_smi: Callable[[], str | None] | None = None) -> int:
    """GPUs Slurm gave this node, else the visible ones, else what nvidia-smi lists, else 0."""
    on_node = env.get("SLURM_GPUS_ON_NODE", "")
    if re.fullmatch(r"[0-9]+", on_node):
        return int(on_node)
    visible = env.get("CUDA_VISIBLE_DEVICES", "")
    if visible and visible != "NoDevFiles":
        return len(visible.split(","))
    listing = (nvidia_smi or _nvidia_smi)()
    return sum(line.startswith("GPU ") for line in (listing or "").splitlines())


def _nvidia_smi() -> str | None:
    try:
        result = subprocess.run(
            ["nvidia-smi", "--list-gpus"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode == 0 else None


def workers_per_node(env: Mapping[str, str], gpus: int) -> int:
    """NPROC_PER_NODE, else one worker per GPU, else two on a CPU node."""
    return int(env["NPROC_PER_NODE"]) if env.get("NPROC_PER_NODE") else (gpus or 2)


def driver_gpus() -> int:
    """The GPUs the NVIDIA driver has on this node, whether or not this job may use them."""
    folder = Path("/proc/driver/nvidia/gpus")
    return len(list(folder.iterdir())) if folder.is_dir() else 0


def planned_world(
    env: Mapping[str, str],
    records: Sequence[tuple[str, str]],
    on_node: Callable[[], int] = driver_gpus,
) -> int:
    """The ranks the launch will start, from the plan's node count and this node's GPUs (every
    node runs as many workers): what the one argument check is told as WORLD_SIZE, so a flag
    that needs a world of one is refused before any node starts. A Slurm job given none of
    its node's GPUs (a cluster that hands them out as gres) is refused, not run on the CPUs."""
    nodes = next((v.split("=", 1)[1] for k, v in records if v.startswith("LLAMA_NNODES=")), "1")
    gpus = detect_gpus(env)
    if not gpus and env.get("SLURM_JOB_ID") and not env.get("NPROC_PER_NODE") and (n := on_node()):
        raise UsageError(
            f"this node has {n} GPUs but the Slurm job was given none (the cluster hands GPUs "
            f"to the jobs that ask): submit with sbatch --gpus-per-node={n}, or add "
            f"#SBATCH --gpus-per-node={n} to 1.train_llama.sbatch"
        )
    return int(nodes) * workers_per_node(env, gpus)


def torchrun_command(
    env: Mapping[str, str], train_args: Sequence[str], gpus: int, cores: int
) -> tuple[list[str], dict[str, str], str]:
    """(torchrun's argv, the variables to add to its environment, one line describing it)."""
    nproc = workers_per_node(env, gpus)
    extra = {}
    if not gpus and "OMP_NUM_THREADS" not in env:
        # torchrun would pin every CPU worker to 1 thread; share the node's cores instead.
        extra["OMP_NUM_THREADS"] = str(max(1, cores // nproc))
    if "RAYON_NUM_THREADS" not in env:
        # The HF tokenizer starts one thread per core in every worker: split the cores.
        extra["RAYON_NUM_THREADS"] = str(max(1, cores // nproc))
    # torchrun must not act on the checkpoint signals (it would die of USR1 or kill the workers
    # 30 s into their save): it ignores them and this launcher passes them on.
    extra["PET_SIGNALS_TO_HANDLE"] = "SIGHUP,SIGQUIT"
    nnodes = int(env.get("LLAMA_NNODES", "1"))
    node = env.get("SLURMD_NODENAME", "")
    if nnodes == 1 and not env.get("SLURM_JOB_ID"):
        rdzv = ["--standalone"]
    else:
        rdzv = [
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={env['LLAMA_RDZV_ENDPOINT']}",
            f"--rdzv_id={env.get('LLAMA_RDZV_ID', env.get('SLURM_JOB_ID', 'local'))}",
        ]
        head = env.get("LLAMA_HEAD_NODE")
        if head and node:  # who hosts the store: by node name, not by matching addresses
            rdzv.append(f"--rdzv_conf=is_host={int(node == head)}")
        addr = node_addr(env, node)
        if addr:  # where the workers' process group meets (MASTER_ADDR), and gloo's side
            rdzv.append(f"--local_addr={addr}")
            if "GLOO_SOCKET_IFNAME" not in env and (name := interface_of(addr)):
                extra["GLOO_SOCKET_IFNAME"] = name
    train_py = str(Path(env["LLAMA_REPO_DIR"]) / "train.py")
    argv = ["torchrun", f"--nnodes={nnodes}", f"--nproc_per_node={nproc}", *rdzv, train_py]
    argv += train_args
    device = f"{gpus} GPU(s)" if gpus else "CPU"
    where = " ".join(x for x in (node, socket.gethostname(), node_addr(env, node)) if x)
    line = (
        f"[node {where}] {device}, {nproc} workers, python {sys.executable}, "
        f"node rank {env.get('SLURM_NODEID', '0')}/{nnodes}"
    )
    return argv, extra, line


#: Where the EFA installer and common images put aws-ofi-nccl (besides LD_LIBRARY_PATH).
OFI_PLUGIN_DIRS = ("/opt/amazon/ofi-nccl/lib", "/opt/amazon/aws-ofi-nccl/lib", "/usr/local/lib")
OFI_PLUGIN_NAMES = ("libnccl-net-ofi.so", "libnccl-net.so")


def efa_devices(sys_class: Path = Path("/sys/class/infiniband")) -> list[str]:
    """RDMA devices driven by the EFA kernel driver (``rdmap*`` on p4d/p5), as the node sees
    them from inside the container."""
    if not sys_class.is_dir():
        return []
    return sorted(
        dev.name
        for dev in sys_class.iterdir()
        if os.path.basename(os.path.realpath(dev / "device" / "driver")) == "efa"
    )


def find_ofi_plugin(env: Mapping[str, str], dirs: Sequence[str] = OFI_PLUGIN_DIRS) -> str | None:
    """The aws-ofi-nccl plugin NCCL would load, searching LD_LIBRARY_PATH first."""
    search = [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d] + list(dirs)
    for folder in search:
        for name in OFI_PLUGIN_NAMES:
            if (Path(folder) / name).is_file():
                return str(Path(folder) / name)
    return None


def network_settings(
    env: Mapping[str, str], devices: Sequence[str], plugin: str | None
) -> tuple[dict[str, str], str]:
    """(NCCL/libfabric variables to set, one line saying what the node will use).

    Decided on the node, inside the container: Pyxis lets the image's own ENV win over what the
    batch script exported, so settings made on the batch host may never reach NCCL. With EFA
    devices and no plugin NCCL would run over TCP sockets (~10x slower all-gathers) while
    looking healthy: refused. Values the user set explicitly are kept.
    """
    if not devices:
        return {}, "network: no EFA device; NCCL chooses (InfiniBand/RoCE if present, else TCP)"
    if plugin is None:
        raise UsageError(
            f"this node has EFA devices ({', '.join(devices)}) but the container has no "
            "aws-ofi-nccl plugin (libnccl-net-ofi.so), so NCCL would fall back to TCP sockets: "
            "build the image with --build-arg INSTALL_EFA=1 (0.transformer-engine.dockerfile)"
        )
    wanted = {"FI_PROVIDER": "efa", "FI_EFA_USE_HUGE_PAGE": "0", "NCCL_NET_PLUGIN": "ofi"}
    extra = {k: v for k, v in wanted.items() if k not in env}
    # Plugin's folder on the loader path, in case the image did not register it with ldconfig.
    folder = str(Path(plugin).parent)
    if folder not in env.get("LD_LIBRARY_PATH", "").split(":"):
        extra["LD_LIBRARY_PATH"] = ":".join(x for x in (folder, env.get("LD_LIBRARY_PATH")) if x)
    merged = {**env, **extra}
    line = (
        f"network: EFA ({len(devices)} devices), NCCL plugin {plugin}, "
        f"FI_PROVIDER={merged['FI_PROVIDER']} NCCL_NET_PLUGIN={merged['NCCL_NET_PLUGIN']} "
        "(NCCL_DEBUG=INFO shows 'NET/OFI Selected provider is efa' when it is used)"
    )
    return extra, line


def interface_of(addr: str) -> str | None:
    """The network interface whose IPv4 address is `addr`, or None. For GLOO_SOCKET_IFNAME:
    unset, gloo's groups (the data reads', the async checkpoints', a CPU run's) bind to what
    the host name resolves to, which may be loopback (Debian's 127.0.1.1), the case
    launch_plan.resolve_node_addrs mends for the rendezvous."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:  # SIOCGIFADDR: the interface's (first) IPv4 address
                answer = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()))
            except OSError:
                continue
        if socket.inet_ntoa(answer[20:24]) == addr:
            return name
    return None


def node_addr(env: Mapping[str, str], node: str) -> str:
    """This node's address in LLAMA_NODE_ADDRS ("node1=10.0.0.1,node2=..."), or ''."""
    for item in env.get("LLAMA_NODE_ADDRS", "").split(","):
        name, _, addr = item.partition("=")
        if node and name == node:
            return addr
    return ""


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (torchrun's workers)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):  # the task ended meanwhile
            found += [int(c) for c in task.read_text().split()]
    return found


class Forwarder:
    """Passes USR1/TERM/INT on to torchrun's workers, and again every few seconds until
    torchrun exits: a worker still importing torch has no handler yet (it inherits the ignore
    from torchrun), and Slurm's proctrack/pgid signals only this process group, while each
    worker runs in a session of its own."""

    def __init__(self, torchrun_pid: int) -> None:
        self.pid = torchrun_pid
        self.pending: list[signal.Signals] = []

    def handle(self, signum: int, frame: object = None) -> None:
        sig = signal.Signals(signum)
        if sig not in self.pending:
            self.pending.append(sig)
            print(
                f"[node {socket.gethostname()}] {sig.name} received: asking train.py to "
                "checkpoint at its next logging step and exit",
                flush=True,
            )
        self.send()

    def send(self) -> None:
        signal_workers(children(self.pid), self.pending)


def signal_workers(pids: Sequence[int], signals: Sequence[signal.Signals]) -> None:
    """Send each of `signals` to each of `pids`; one already gone is passed by."""
    for pid in pids:
        for sig in signals:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)


def _torchrun_child_setup(launcher_pid: int) -> Callable[[], None]:
    """In torchrun's process before it starts: ignore the forwarded signals (the launcher
    passes them on) and die with the launcher (Linux's parent-death signal)."""

    def setup() -> None:
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_IGN)
        if sys.platform.startswith("linux"):
            import ctypes

            pr_set_pdeathsig = 1
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(pr_set_pdeathsig, int(PARENT_DEATH_SIGNAL), 0, 0, 0)
            if os.getppid() != launcher_pid:  # the launcher died before the signal was set
                os._exit(128 + int(PARENT_DEATH_SIGNAL))

    return setup


def run_node(train_args: Sequence[str], env: Mapping[str, str] = os.environ) -> int:
    """torchrun with the signals passed on to its workers; its exit status. (The arguments
    were checked once, by the sbatch, before any node started.)"""
    os.chdir(env["LLAMA_REPO_DIR"])  # relative paths mean the same as in the container
    gpus = detect_gpus(env)
    argv, extra, line = torchrun_command(env, train_args, gpus, os.cpu_count() or 1)
    if env.get("LLAMA_CONTAINER_IMAGE"):  # the node's image, before its first step
        print(container_report(env), flush=True)
    print(line, flush=True)
    hint = slow_bf16_hint(train_args, gpus, cpu.cpu_computes_bf16())
    if hint:
        print(f"{line[: line.index(']') + 1]} {hint}", flush=True)
    if gpus:  # NCCL's network; a CPU run's gloo has nothing to choose
        network, network_line = network_settings(env, efa_devices(), find_ofi_plugin(env))
        extra.update(network)
        print(f"{line[: line.index(']') + 1]} {network_line}", flush=True)
    forwarder = Forwarder(-1)
    for sig in FORWARDED:  # from here on a signal is never lost, even before torchrun exists
        signal.signal(sig, forwarder.handle)
    torchrun = subprocess.Popen(
        argv,
        env={**env, **extra},
        preexec_fn=_torchrun_child_setup(os.getpid()),
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
    )
    forwarder.pid = torchrun.pid
    errors = TorchrunErrors(sys.stderr)
    reader = threading.Thread(target=errors.pump, args=(torchrun.stderr,), daemon=True)
    reader.start()
    while True:
        try:
            status = torchrun.wait(timeout=min(RESEND_EVERY_S, TEARDOWN_S))
            break
        except subprocess.TimeoutExpired:
            if forwarder.pending:
                forwarder.send()
            if errors.stopping_for() > TEARDOWN_S:  # a worker failed; the rest did not end
                signal_workers(children(torchrun.pid), [signal.SIGKILL])
    reader.join()
    return errors.finish(status if status >= 0 else 128 - status)


class TorchrunErrors:
    """Passes torchrun's stderr (its workers' too) on, holding back torchrun's own report of a
    failed worker ("failed (exitcode: N)", traceback, box): a worker that exited 2 refused its
    input in one line already (a run folder another launch just took), one that exited 4 named
    its hang and its stacks, so the launch exits with that code and that line alone; any other
    failure gets torchrun's report as written. It also notes when torchrun starts stopping the
    other workers, which the launcher bounds (TEARDOWN_S)."""

    FAILED = re.compile(r"elastic/multiprocessing/api\.py.*failed \(exitcode: (-?\d+)\)")
    #: torchrun stopping the other workers after one failed (its 30 s grace starts here)
    STOPPING = re.compile(r"Sending process \d+ closing signal")

    def __init__(self, out) -> None:
        self.out = out
        self.held: list[str] = []
        self.code: int | None = None
        self.stopping_since: float | None = None

    def stopping_for(self) -> float:
        """Seconds since torchrun began stopping the workers (0 if it has not)."""
        return 0.0 if self.stopping_since is None else time.monotonic() - self.stopping_since

    def pump(self, stream) -> None:
        for line in stream:
            if self.stopping_since is None and self.STOPPING.search(line):
                self.stopping_since = time.monotonic()
            found = self.FAILED.search(line) if self.code is None else None
            if found:
                self.code = int(found.group(1))
            if self.code is None:
                self.out.write(line)
                self.out.flush()
            self.held += [line] if self.code is not None else []

    def finish(self, status: int) -> int:
        """The launch's exit status: the failed worker's where its own line explains it (2: a
        refusal, 4: a hang), else torchrun's (its report written)."""
        if self.code in OWN_LINE_CODES:
            return self.code
        self.out.writelines(self.held)
        self.out.flush()
        return status


def remove_unused(folders: Sequence[str]) -> None:
    """Remove each folder that holds nothing, or only a run lock no process holds (train.py's
    RunLock, released by a run refused after start-up): a refusal leaves no run folder."""
    for folder in folders:
        with contextlib.suppress(OSError):
            if os.listdir(folder) == [LOCK_FILE]:
                with open(lock := os.path.join(folder, LOCK_FILE)) as held:
                    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a live run: OSError
                    os.unlink(lock)
            os.rmdir(folder)


def container_report(env: Mapping[str, str]) -> str:
    """One line from inside the image: its hostname, Python, torch and Transformer Engine."""

    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "none"

    return (
        f"container: {socket.gethostname()}: Python {platform.python_version()} "
        f"({sys.executable}), torch {version('torch')}, transformer_engine "
        f"{version('transformer_engine')}"
    )


# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    command, args, env = argv[0], list(argv[1:]), os.environ
    try:
        if command == "plan":
            records = launch_records(env, args)
            records.append(("env", f"LLAMA_WORLD_SIZE={planned_world(env, records)}"))
            sys.stdout.write("".join(f"{key}={value}\0" for key, value in records))
        elif command == "finished":
            return 0 if published.finished(args[0]) else 1
        elif command == "unmade":
            remove_unused(args)
        elif command == "node":
            return run_node(args, env)
        else:
            print(f"launcher.py: unknown command {command}\n{__doc__}", file=sys.stderr)
            return 2
    except UsageError as exc:
        print(f"1.train_llama.sbatch: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
