"""One launch of 1.train_llama.sbatch, decided on the batch host before any node starts
(`launcher.py plan`): train.py's arguments (the script's defaults, the run folder and
`--resume_from_checkpoint auto` where the user did not decide otherwise, what a requeue must
not repeat), the folders in effect, whether to train at all (--help, --validate_only), where the
job runs (the image through Pyxis, else the host's Python) and the rendezvous its nodes meet at.
Standard library only, like launcher.py.
"""

from __future__ import annotations

import contextlib
import importlib.util
import ipaddress
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def _load(relative: str) -> ModuleType:
    """A standard-library module of model_utils, loaded from its file: importing the package
    would import torch (model_utils/checkpoint/__init__.py does), which a batch host may lack."""
    name = "llama_launch_" + Path(relative).stem
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / relative)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before running it: dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


argv = _load("model_utils/config/argv.py")  # train.py's grammar: one definition for both
published = _load("model_utils/checkpoint/published.py")  # what a complete checkpoint is
flag_value, switch_value, without_flag = argv.flag_value, argv.switch_value, argv.without_flag
cpu = _load("scripts/cpu.py")  # whether a CPU-only node computes bf16 natively


def slow_bf16_hint(train_args: Sequence[str], gpus: int, native_bf16: bool | None) -> str:
    """On a node without GPUs whose CPU has no bf16 units, a bf16 run (the default) is 20-30x
    slower than --bf16=0: one line saying so ('' elsewhere). Said, not decided: a run's flags
    and its folder's name never depend on the CPU model."""
    if gpus or native_bf16 is not False or not switch_value(expanded(train_args), "bf16", True):
        return ""
    return f"{cpu.slow_bf16_line()}; --bf16=0 computes in fp32 (FP8 still emulated)"


class UsageError(Exception):
    """A setting the user must change: one line, exit 2."""


def expanded(args: Sequence[str], files_only: bool = False) -> list[str]:
    """`args` as train.py reads them (every flag the launcher reads): each `@FILE` expanded
    and, unless `files_only`, each --recipe (UsageError if unknown or unreadable)."""
    recipes = _load("model_utils/config/recipes.py")
    try:
        return (recipes.expand_files if files_only else recipes.expand)(args)
    except recipes.RecipeError as exc:
        raise UsageError(str(exc)) from exc


def precision(args: Sequence[str]) -> str:
    """fp8, bf16 or fp32, as train.py names a run's precision (its default --output_dir)."""
    return argv.precision_of(expanded(args))


def run_folder(run_dir: str, args: Sequence[str], named: bool) -> str:
    """The run folder: a RUN_NAME is taken as given; a job name (or `local`) gets the precision
    appended unless it ends with it, so `--fp8=1` and `--fp8=0` of one command are two runs (one
    folder would have the second resume the first one's checkpoints and re-label them)."""
    if named:
        return run_dir
    suffix = f"-{precision(args)}"
    return run_dir if run_dir.endswith(suffix) else run_dir + suffix


#: train.py's flags that this launcher reads: an abbreviation of one (argparse takes --output
#: for --output_dir) would get past it, and e.g. split the run between two folders.
READ_FLAGS = (
    "output_dir",
    "checkpoint_dir",
    "resume_from_checkpoint",
    "overwrite_output_dir",
    "validate_only",
    "help",
)


def check_spelled_out(args: Sequence[str]) -> None:
    """UsageError for an abbreviation of a flag in READ_FLAGS, before anything is created."""
    for arg in expanded(args):
        name = arg[2:].split("=", 1)[0] if arg.startswith("--") else ""
        matches = [
            f"--{full}" for full in READ_FLAGS if name and full != name and full.startswith(name)
        ]
        if matches:
            raise UsageError(
                f"--{name}: write {' or '.join(matches)} in full (the launcher reads it and "
                "would miss an abbreviation)"
            )


def for_requeue(
    args: Sequence[str], restart: int, checkpoint_dir: str, saved: bool
) -> tuple[list[str], str]:
    """The user's arguments for restart number `restart` of a job, and a log line if changed.

    A requeued job re-runs its first arguments, but its checkpoints are now its own progress:
    --overwrite_output_dir would delete them, and an explicit --resume_from_checkpoint PATH
    would go back to PATH and redo (and overwrite) the steps since. Both go (an @FILE's too:
    its arguments then stand in its place), and the run resumes from its own newest checkpoint.
    A PATH stays while the run has `saved` nothing yet: the restart would train from scratch."""
    kept, dropped = expanded(args, files_only=True), []
    if switch_value(kept, "overwrite_output_dir"):
        dropped.append("--overwrite_output_dir")
        kept = without_flag(kept, "overwrite_output_dir", optional_value=True)
    path = flag_value(kept, "resume_from_checkpoint")
    if saved and path not in (None, "auto"):
        dropped.append(f"--resume_from_checkpoint {path}")
        kept = without_flag(kept, "resume_from_checkpoint")
    if not dropped:
        return list(args), ""
    note = (
        f"restart {restart}: without {' and '.join(dropped)} (for the first start only): "
        f"resuming from the newest checkpoint in {checkpoint_dir}"
        + ("" if saved else " (none yet: a fresh start)")
    )
    return kept, note


def train_arguments(defaults: Sequence[str], run_dir: str, args: Sequence[str]) -> list[str]:
    """train.py's arguments: the script's defaults, the launcher's run folder and resume, then
    the user's (argparse: the last one wins). The launcher's own flags are left out where the
    user decided: --output_dir (the checkpoints follow it, as train.py's default does), and
    `--resume_from_checkpoint auto` with their own resume or --overwrite_output_dir (which
    train.py refuses together)."""
    given = expanded(args)
    own = [] if flag_value(given, "output_dir") is not None else ["--output_dir", run_dir]
    if flag_value(given, "init_from_hf") is not None:
        defaults = without_flag(defaults, "preset")  # the model is the checkpoint's config.json
    if flag_value(given, "resume_from_checkpoint") is None and not switch_value(
        given, "overwrite_output_dir"
    ):
        own += ["--resume_from_checkpoint", "auto"]
    return [*defaults, *own, *args]


def run_folders(train_args: Sequence[str]) -> tuple[str, str]:
    """(checkpoint folder, run folder) train.py will use, absolute as it resolves them (from
    the repository): --checkpoint_dir defaults to <output_dir>/checkpoints."""
    given = expanded(train_args)
    out = os.path.expanduser(flag_value(given, "output_dir") or "")
    ckpt = os.path.expanduser(flag_value(given, "checkpoint_dir") or "")
    ckpt = ckpt or os.path.join(out, "checkpoints")
    return os.path.abspath(ckpt), os.path.abspath(out)


def launch_mode(args: Sequence[str]) -> str:
    """'help' (-h/--help), 'validate' (--validate_only) or 'train': the first two are answered
    by the launcher's one argument check, with no torchrun and no run folder."""
    given = expanded(args)
    asked = "help" if any(arg in ("-h", "--help") for arg in given) else None
    return asked or ("validate" if switch_value(given, "validate_only") else "train")


def restart_count(env: Mapping[str, str]) -> int:
    """How often Slurm has requeued this job (0 outside a job: a stray variable means nothing)."""
    restart = env.get("SLURM_RESTART_COUNT", "") if env.get("SLURM_JOB_ID") else ""
    return int(restart) if restart.isdigit() else 0


def run_name(env: Mapping[str, str]) -> str:
    """The run's name, hence its folder: RUN_NAME, else the job's name, else `local`; a stable
    one, so that the same command (a requeue, a resubmission, a rerun) resumes the same
    checkpoints."""
    name = env.get("RUN_NAME") or (env.get("SLURM_JOB_NAME") or "llama")
    name = name if env.get("RUN_NAME") or env.get("SLURM_JOB_ID") else "local"
    if "/" in name or "\n" in name or name.strip() in ("", ".", ".."):  # " ": no one sees it
        raise UsageError(f"RUN_NAME/job name {name!r} must be a plain folder name, on one line")
    return name


@dataclass
class Plan:
    """What one launch does: train.py's arguments, the folders in effect (checkpoints, run),
    the mode (train, validate, help) and a note for the log (a requeue's rewriting)."""

    train_args: list[str]
    checkpoint_dir: str
    output_dir: str
    mode: str
    note: str


def from_caller(args: Sequence[str], caller: str) -> list[str]:
    """`args` as meant in `caller`, the folder the script was run or submitted from, though
    the launch runs in the checkout: each @FILE read there, each relative path flag made
    absolute there (one read only where it exists there: else a Hub name or the checkout's)."""
    here = os.getcwd()
    os.chdir(caller)
    try:
        args = expanded(args, files_only=True)
    finally:
        os.chdir(here)
    out, pending = [], ""
    for arg in args:
        name, eq, value = arg[2:].partition("=")
        if pending:  # the value of `--FLAG VALUE`
            arg, pending = caller_path(caller, pending, arg), ""
        elif arg.startswith("--") and name in argv.OUTPUT_PATH_FLAGS + argv.INPUT_PATH_FLAGS:
            arg, pending = (
                (f"--{name}={caller_path(caller, name, value)}", "") if eq else (arg, name)
            )
        out.append(arg)
    return out


def caller_path(caller: str, flag: str, value: str) -> str:
    """A path flag's value as meant in `caller`: an output's always, an input's where it exists
    there (`auto` is --resume_from_checkpoint's word, no folder)."""
    path = os.path.join(caller, os.path.expanduser(value))  # an absolute value stays itself
    if flag in argv.OUTPUT_PATH_FLAGS:
        return path if value else value
    return path if value and value != "auto" and os.path.exists(path) else value


def plan(env: Mapping[str, str], defaults: Sequence[str], args: Sequence[str]) -> Plan:
    """The launch of `args` after the script's `defaults`, in RUNS_DIR/<run name>; relative
    paths in `args` are the caller's (LLAMA_CALLER_DIR, where it is not the checkout)."""
    caller = env.get("LLAMA_CALLER_DIR", "")
    if caller and os.path.realpath(caller) != os.path.realpath(env.get("LLAMA_REPO_DIR", REPO)):
        args = from_caller(args, caller)
    check_spelled_out(args)
    runs = env.get("RUNS_DIR") or os.path.join(env.get("LLAMA_REPO_DIR") or str(REPO), "runs")
    named = bool(env.get("RUN_NAME"))
    run_dir = run_folder(os.path.join(runs, run_name(env)), [*defaults, *args], named=named)
    checkpoint_dir, output_dir = run_folders(train_arguments(defaults, run_dir, args))
    note, restart = "", restart_count(env)
    if restart > 0:
        saved = published.latest_checkpoint(checkpoint_dir) is not None
        args, note = for_requeue(args, restart, checkpoint_dir, saved)
    train_args = train_arguments(defaults, run_dir, args)
    return Plan(train_args, checkpoint_dir, output_dir, launch_mode(args), note)


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
    """Create the folders; return every folder that did not exist before, deepest first.
    One that cannot be made is one line, and what was made for the others is removed."""
    wanted = [Path(path).absolute() for path in paths]
    missing = {str(p) for path in wanted for p in (path, *path.parents) if not p.exists()}
    created = sorted(missing, key=lambda folder: (-folder.count(os.sep), folder))
    try:
        for path in wanted:
            path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        for folder in created:
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        why = f"cannot create {exc.filename} ({exc.strerror}): point RUNS_DIR"
        raise UsageError(f"{why}, --output_dir or --checkpoint_dir elsewhere") from None
    return created


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


# ---- Rendezvous by address


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


# ---- The plan the sbatch reads


def host_python(env: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """(PATH to export, the python it finds) for a run on the host's Python: VENV, else the
    repository's .venv, else PATH as it is; torchrun comes with that Python."""
    venv = env.get("VENV") or ""
    repo_venv = Path(env.get("LLAMA_REPO_DIR") or REPO) / ".venv"
    if not venv and (repo_venv / "bin" / "python").is_file():
        venv = str(repo_venv)
    path = env.get("PATH", "")
    if venv:
        if not os.access(Path(venv) / "bin" / "python", os.X_OK):
            raise UsageError(f"VENV={venv} has no bin/python")
        path = f"{venv}/bin:{path}"
    if not shutil.which("torchrun", path=path):
        raise UsageError("torchrun not found (set VENV or install torch)")
    return {"PATH": path}, shutil.which("python", path=path) or "python"


def container_hf_home(env: Mapping[str, str]) -> str:
    """HF_HOME for a Pyxis run: the image's root (home included) is read-only, so the Hugging
    Face cache must be a host folder mounted at the same path; unset, the user's own cache."""
    hf_home = env.get("HF_HOME") or ""
    if not hf_home:
        base = env.get("XDG_CACHE_HOME") or (env["HOME"] + "/.cache" if env.get("HOME") else "")
        if not base:
            raise UsageError(
                "neither HF_HOME nor HOME is set: set HF_HOME to a folder every node can write"
            )
        hf_home = base + "/huggingface"
    try:
        os.makedirs(hf_home, exist_ok=True)
    except OSError:
        raise UsageError(
            f"HF_HOME={hf_home} cannot be created: set HF_HOME to a folder every node can write"
        ) from None
    return hf_home


def has_pyxis() -> bool:
    """Does srun take --container-image (the Pyxis plugin)?"""
    try:
        found = subprocess.run(["srun", "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--container-image" in found.stdout + found.stderr


def slurm_records(env: Mapping[str, str], folders: Sequence[str]) -> list[tuple[str, str]]:
    """The job's part of the plan: where it runs (the image through Pyxis, else the host's
    Python), the rendezvous every node meets at, and the folders the mounts need (created last,
    after every check that can refuse)."""
    repo = env.get("LLAMA_REPO_DIR") or str(REPO)
    env = {**env, "LLAMA_REPO_DIR": repo, "RUNS_DIR": env.get("RUNS_DIR") or f"{repo}/runs"}
    image = env.get("IMAGE") or f"{repo}/transformer-engine.sqsh"
    if env.get("IMAGE") and image.endswith(".sqsh") and not os.path.isfile(image):
        raise UsageError(
            f"IMAGE={image} does not exist (build it: see 0.transformer-engine.dockerfile)"
        )
    pyxis = has_pyxis() and (os.path.isfile(image) or bool(env.get("IMAGE")))
    if pyxis:
        env["HF_HOME"] = container_hf_home(env)
        records = [("env", f"HF_HOME={env['HF_HOME']}"), ("env", f"LLAMA_CONTAINER_IMAGE={image}")]
        records += [("say", f"container: {image} (Pyxis)")]
    else:
        path, python = host_python(env)
        why = "srun has no --container-image (no Pyxis)"
        why = why if os.path.isfile(image) else f"no container image at {image}"
        records = [("env", f"PATH={path['PATH']}"), ("say", f"host Python {python}: {why}")]
    head, head_addr, node_addrs = rendezvous(env).split(" ")
    nnodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1"
    job = env["SLURM_JOB_ID"]
    endpoint = f"{head_addr}:{env.get('RDZV_PORT') or 20000 + int(job) % 20000}"
    for name, value in (
        ("LLAMA_NNODES", nnodes),
        ("LLAMA_RDZV_ID", job),
        ("LLAMA_HEAD_NODE", head),
        ("LLAMA_RDZV_ENDPOINT", endpoint),
        ("LLAMA_NODE_ADDRS", node_addrs),
    ):
        records.append(("env", f"{name}={value}"))
    records.append(
        (
            "say",
            f"job {job} ({env.get('SLURM_JOB_NAME', '')}), restart "
            f"{env.get('SLURM_RESTART_COUNT', '0')}: {nnodes} node(s) "
            f"{env.get('SLURM_JOB_NODELIST', '')}, rendezvous {endpoint} ({head}), "
            f"run folder {folders[-1]}",
        )
    )
    records += [("created", path) for path in make_dirs(folders)]  # Pyxis mounts need them
    if pyxis:
        records += [
            ("container", f"--container-image={image}"),
            ("container", f"--container-name=llama-{job}"),
            ("container", f"--container-mounts={container_mounts(env, folders)}"),
            ("container", f"--container-workdir={repo}"),
        ]
    return records


def launch_records(env: Mapping[str, str], argv: Sequence[str]) -> list[tuple[str, str]]:
    """`plan N DEFAULTS(N)... ARGS...`: every decision of one launch, as (key, value) records."""
    check_environment(env)
    count = int(argv[0])
    defaults, args = list(argv[1 : 1 + count]), list(argv[1 + count :])
    launch = plan(env, defaults, args)
    folders = [launch.checkpoint_dir, launch.output_dir]
    records = [
        ("mode", launch.mode),
        ("checkpoint_dir", launch.checkpoint_dir),
        ("output_dir", launch.output_dir),
        *(("arg", arg) for arg in launch.train_args),
    ]
    if env.get("SLURM_JOB_ID"):
        records += slurm_records(env, folders)
    else:
        path, _ = host_python(env)
        records.append(("env", f"PATH={path['PATH']}"))  # the folders wait for the check
    if launch.note:
        records.append(("say", launch.note))
    return records
