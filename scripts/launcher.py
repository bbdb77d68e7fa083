"""What 1.train_llama.sbatch does besides talking to Slurm, where it can be tested.

Standard library only: on the batch host it runs on whatever `python3` is there (3.8 or newer),
on the nodes on the job's Python (the container's, or the venv's). Subcommands:

  check-env                 exit 2 with one line for settings that would fail deep in bash/torchrun
  plan RUN_DIR N DEFAULTS(N)... ARGS...
                            bash assignments: train.py's arguments, the folders in effect, the
                            mode (train, validate, help) and a note for the log (requeues)
  make-dirs DIR...          create them; print the folders that did not exist (for remove-empty)
  remove-empty DIR...       remove those of them that are still empty (a refused start)
  mounts DIR...             Pyxis --container-mounts: repo, RUNS_DIR, DIR..., DATA_PATH, HF_HOME
  rendezvous                "HEAD_NODE HEAD_ADDR NODE=ADDR,..." for this job's nodes (scontrol)
  finished CKPT_DIR         exit 0 when the newest checkpoint is at the run's max_steps
  node ARGS...              on every node: torchrun with one worker per GPU, signals forwarded
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from launch_plan import UsageError, plan

# The signals that ask train.py for a checkpoint at its next logging step, then an exit.
FORWARDED = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
RESEND_EVERY_S = 5.0


def check_environment(env: Mapping[str, str]) -> None:
    nproc = env.get("NPROC_PER_NODE", "")
    if nproc and not re.fullmatch(r"[1-9][0-9]*", nproc):
        raise UsageError(
            f"NPROC_PER_NODE={nproc} is not a number of workers per node >= 1 "
            "(unset it for one worker per GPU, or 2 on a CPU-only node)"
        )
    nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or ""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    job_id = env.get("SLURM_JOB_ID", "")
    if nodes and not re.fullmatch(r"[1-9][0-9]*", nodes):
        raise UsageError(f"SLURM_NNODES={nodes} is not a number of nodes >= 1")
    if job_id and not nodelist:
        raise UsageError(
            f"SLURM_JOB_ID={job_id} is set but SLURM_JOB_NODELIST is not: submit with sbatch "
            "(or run inside salloc), or unset SLURM_JOB_ID to train on this machine"
        )
    if not job_id and nodes and int(nodes) > 1:
        raise UsageError(
            f"SLURM_NNODES={nodes} asks for {nodes} nodes outside a Slurm job (no SLURM_JOB_ID "
            f"or node list): submit with sbatch --nodes={nodes}, or unset SLURM_NNODES to train "
            "on this machine"
        )


def make_dirs(paths: Sequence[str]) -> list[str]:
    """Create the folders; return every folder that did not exist before, deepest first."""
    created: list[str] = []
    for path in paths:
        p = Path(path).absolute()
        missing = []
        while not p.exists():
            missing.append(str(p))
            p = p.parent
        Path(path).mkdir(parents=True, exist_ok=True)
        created.extend(m for m in missing if m not in created)
    return created


def remove_empty(paths: Sequence[str]) -> None:
    """Remove those of `paths` that are empty folders, children before parents."""
    for path in sorted(paths, key=lambda p: p.count(os.sep), reverse=True):
        try:
            os.rmdir(path)
        except OSError:
            pass


def container_mounts(env: Mapping[str, str], paths: Sequence[str]) -> str:
    """Pyxis --container-mounts: every host folder train.py reads or writes, at the same path.
    RUNS_DIR only when it exists: with the user's own --output_dir elsewhere it may not, and
    Pyxis refuses to mount a missing folder."""
    runs = env.get("RUNS_DIR", "")  # other runs' checkpoints, to resume or import from
    wanted = [env["LLAMA_REPO_DIR"], runs if os.path.isdir(runs) else "", *paths]
    wanted += [env[name] for name in ("DATA_PATH", "HF_HOME") if env.get(name)]
    mounts = [f"{p}:{p}" for p in dict.fromkeys(p for p in wanted if p)]
    if env.get("EXTRA_MOUNTS"):
        mounts.append(env["EXTRA_MOUNTS"])
    return ",".join(mounts)


def run_finished(checkpoint_dir: str) -> bool:
    """Did the run reach max_steps? The newest published checkpoint (step_N/checkpoint.json)
    records its step and the run's max_steps: a signal that came too late (or was lost while
    train.py was starting) must not requeue a finished run."""
    found = sorted(Path(checkpoint_dir).glob("step_*/checkpoint.json"))
    if not found:
        return False
    try:
        meta = json.loads(found[-1].read_text())
        return int(meta["step"]) >= int(meta["run_config"]["max_steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


# --------------------------------------------------------------------------------------------
# Rendezvous by address


def parse_node_addrs(scontrol_show_node: str) -> dict[str, str]:
    """NodeName -> NodeAddr from `scontrol show node --oneliner` (NodeAddr defaults to the
    name; it is how slurmctld itself reaches the node)."""
    nodes = {}
    for line in scontrol_show_node.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if "NodeName" in fields:
            nodes[fields["NodeName"]] = fields.get("NodeAddr") or fields["NodeName"]
    return nodes


def _ipv4(host: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    return list(dict.fromkeys(info[4][0] for info in infos))


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def _source_address_towards(peer: str) -> str | None:
    """This machine's address on the route to `peer` (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def resolve_node_addrs(
    hosts: Sequence[str],
    node_addrs: Mapping[str, str],
    this_node: str | None = None,
    resolve: Callable[[str], list[str]] = _ipv4,
    source_towards: Callable[[str], str | None] = _source_address_towards,
) -> dict[str, str]:
    """Node -> IPv4 address the other nodes can reach, for the job's `hosts`.

    NodeAddr is resolved here (it may be a name); a node whose name resolves only to loopback
    (Debian's "127.0.1.1 myhost" line) on the batch host, which is `this_node`, gets the
    address this machine uses towards another node instead. An unresolvable node keeps its
    NodeAddr and torch resolves it (or says it cannot)."""
    out = {}
    for host in hosts:
        name = node_addrs.get(host, host)
        found = resolve(name)
        usable = [a for a in found if not _is_loopback(a)]
        out[host] = usable[0] if usable else (found[0] if found else name)
    if this_node in out and _is_loopback(out[this_node]):
        peers = [out[h] for h in hosts if h != this_node and not _is_loopback(out[h])]
        own = source_towards(peers[0]) if peers else None
        if own:
            out[this_node] = own
    return out


def rendezvous(env: Mapping[str, str], run: Callable[..., str] | None = None) -> str:
    """'HEAD_NODE HEAD_ADDR NODE=ADDR,...' for the job's nodes, head (first) node first.

    torchrun's c10d store listens on the head node; the others reach it by address, not by
    NodeName (which need not be a DNS name, or may differ from the node's hostname). As in
    torchtitan's multinode_trainer.slurm, but from Slurm's NodeAddr, the address slurmctld
    itself uses to reach the node."""
    run = run or _scontrol
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    hosts = run("show", "hostnames", nodelist).split()
    if not hosts:
        raise UsageError(f"scontrol show hostnames '{nodelist}' listed no node")
    try:
        node_addrs = parse_node_addrs(run("show", "node", "--oneliner", nodelist))
    except subprocess.CalledProcessError:
        node_addrs = {}
    addrs = resolve_node_addrs(hosts, node_addrs, env.get("SLURMD_NODENAME") or hosts[0])
    return " ".join([hosts[0], addrs[hosts[0]], ",".join(f"{h}={a}" for h, a in addrs.items())])


def _scontrol(*args: str) -> str:
    return subprocess.run(
        ["scontrol", *args], capture_output=True, text=True, check=True, timeout=60
    ).stdout


# --------------------------------------------------------------------------------------------
# The per-node part: torchrun with one worker per GPU


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


def torchrun_command(
    env: Mapping[str, str], train_args: Sequence[str], gpus: int, cores: int
) -> tuple[list[str], dict[str, str], str]:
    """(torchrun's argv, the variables to add to its environment, one line describing it)."""
    nproc = int(env["NPROC_PER_NODE"]) if env.get("NPROC_PER_NODE") else (gpus or 2)
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
        if node_addr(env, node):  # where the workers' process group meets (MASTER_ADDR)
            rdzv.append(f"--local_addr={node_addr(env, node)}")
    argv = [
        "torchrun",
        f"--nnodes={nnodes}",
        f"--nproc_per_node={nproc}",
        *rdzv,
        str(Path(env["LLAMA_REPO_DIR"]) / "train.py"),
        *train_args,
    ]
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
        try:
            found += [int(c) for c in task.read_text().split()]
        except OSError:
            pass
    return found


class Forwarder:
    """Passes USR1/TERM/INT on to torchrun's workers, and again every few seconds until
    torchrun exits: a worker still importing torch has no handler yet (it inherits the ignore
    from torchrun), and Slurm's proctrack/pgid signals only this process group, while each
    worker runs in a session of its own."""

    def __init__(self, torchrun_pid: int, workers: Callable[[int], list[int]] = children):
        self.pid = torchrun_pid
        self.workers = workers
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
        for pid in self.workers(self.pid):
            for sig in self.pending:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass


def _ignore_forwarded() -> None:
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_IGN)


def run_node(train_args: Sequence[str], env: Mapping[str, str] = os.environ) -> int:
    """torchrun with the signals passed on to its workers; its exit status. (The arguments
    were checked once, by the sbatch, before any node started.)"""
    os.chdir(env["LLAMA_REPO_DIR"])  # relative paths mean the same as in the container
    gpus = detect_gpus(env)
    argv, extra, line = torchrun_command(env, train_args, gpus, os.cpu_count() or 1)
    print(line, flush=True)
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
        preexec_fn=_ignore_forwarded,
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
            status = torchrun.wait(timeout=RESEND_EVERY_S)
            break
        except subprocess.TimeoutExpired:
            if forwarder.pending:
                forwarder.send()
    reader.join()
    return errors.finish(status if status >= 0 else 128 - status)


class TorchrunErrors:
    """Passes torchrun's stderr (its workers' too) on, holding back torchrun's own report of a
    failed worker ("failed (exitcode: N)", traceback, box): a worker that exited 2 refused its
    input in one line already (a run folder another launch just took), so the launch exits 2
    with that line alone; any other failure gets torchrun's report as written."""

    FAILED = re.compile(r"elastic/multiprocessing/api\.py.*failed \(exitcode: (-?\d+)\)")

    def __init__(self, out) -> None:
        self.out = out
        self.held: list[str] = []
        self.code: int | None = None

    def pump(self, stream) -> None:
        for line in stream:
            found = self.FAILED.search(line) if self.code is None else None
            if found:
                self.code = int(found.group(1))
            if self.code is None:
                self.out.write(line)
                self.out.flush()
            self.held += [line] if self.code is not None else []

    def finish(self, status: int) -> int:
        """The launch's exit status: 2 for a refusal, else torchrun's (its report written)."""
        if self.code == 2:
            return 2
        self.out.writelines(self.held)
        self.out.flush()
        return status


# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    command, args, env = argv[0], list(argv[1:]), os.environ
    try:
        if command == "check-env":
            check_environment(env)
        elif command == "plan":
            print(plan(env, args))
        elif command == "make-dirs":
            print("\n".join(make_dirs(args)))
        elif command == "remove-empty":
            remove_empty(args)
        elif command == "mounts":
            print(container_mounts(env, args))
        elif command == "rendezvous":
            print(rendezvous(env))
        elif command == "finished":
            return 0 if run_finished(args[0]) else 1
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
