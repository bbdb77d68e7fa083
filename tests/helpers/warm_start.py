"""Warm starts for the test suite's Python processes: a fork server ("zygote") that has imported
torch, transformers and the recipe once, and a stand-in ``python`` that asks it for a process.

Why: a train.py process on the CI box spends about half of its CPU time importing (torch,
transformers' Llama, datasets; benchmarks/results/2026-11-28-make-test.md), and the suite starts
a few hundred of them to test resumes, failures and multi-rank runs, where the start-up is not
the point. A forked child of the zygote is still a real process with its own pid, its own gloo
connections, signals, exit status and stdio: only the imports are inherited.

How a process starts warm:
- The stand-in (:func:`client_main`, written as an executable by :func:`write_stand_in`) is
  what the tests run instead of ``sys.executable`` (and what torchrun runs for its workers:
  ``PYTHON_EXEC``). It sends its arguments, environment, working directory and stdin, stdout
  and stderr to the zygote, waits, and exits as the child exited (code or signal). Signals it
  receives (TERM, INT, USR1, ...) are passed on to the child; if the stand-in is killed, the
  zygote kills the child, so a test's timeout or ``proc.kill()`` ends the real process.
- The zygote forks, and the child becomes the program: a new session, the sent fds as 0/1/2,
  the environment, ``sys.argv``/``sys.path`` as Python sets them, then the script, module or
  ``-c`` code as ``__main__``, and the interpreter's own exit (atexit, flushes).
- Anything the zygote cannot reproduce runs cold, by ``execve`` of the real interpreter with
  the same arguments: an environment that differs from the zygote's in a variable read at
  import time (PYTHON*, HF_*, TORCH*, ...), a Python option other than -u/-B/-W/-X
  faulthandler, no zygote running (``LLAMA_TEST_WARM_SOCKET`` unset or gone). glibc's mmap
  threshold (a memory test's) is no reason: the child sets it with ``mallopt``.

What stays cold on purpose: a user's own start of an entry point (the signalled
``bash 1.train_llama.sbatch`` run and its resume, Slurm, the container, the demo), and a process
a test stops with SIGSTOP or finds as another's child. The launcher's Python processes start
warm where a test checks what it decides, and in the plain local run (tests/helpers/procs.py
``warm_venv``).
tests/integration/test_warm_start.py holds a cold and a warm train.py run to the same output.
``LLAMA_TEST_WARM=0`` starts no zygote (everything cold); ``LLAMA_TEST_WARM_LOG=FILE`` writes a
line per cold fallback with the variables that caused it.

This module imports only the standard library at its top: the stand-in runs it with ``-S``.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import struct
import sys

SOCKET_ENV = "LLAMA_TEST_WARM_SOCKET"
REAL_PYTHON_ENV = "LLAMA_TEST_REAL_PYTHON"
LOG_ENV = "LLAMA_TEST_WARM_LOG"
PID_ENV = "LLAMA_TEST_WARM_PID"
STAND_IN_ENV = "LLAMA_TEST_WARM_PYTHON"

#: What the zygote imports before it forks: the heavy imports of a train.py run (the recipe's
#: stages, torch's distributed packages, transformers' Llama, datasets, torchao's float8 and
#: low-bit optimizers) and of a torchrun agent.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.run",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "transformers",
    "datasets",
    "tokenizers",
    "safetensors.torch",
    "torchao.float8",
    "torchao.optim",
    "train",
    "te_llama",
    "model_utils.checkpoint",
    "model_utils.data",
    "model_utils.config.arguments",
    "model_utils.model.modeling",
    "model_utils.precision.backends",
    "model_utils.report.run_log",
    # transformers imports lazily: its Llama and Mistral models (with modeling_utils, the loss
    # zoo, scipy and accelerate behind them) and the fast tokenizer's classes load on first use,
    # ~650 modules that every train.py child imported again after the fork
    "transformers.models.llama.modeling_llama",
    "transformers.models.mistral.modeling_mistral",
    "transformers.models.auto.tokenization_auto",
    "transformers.tokenization_utils_tokenizers",
    "transformers.convert_slow_tokenizer",
    "scipy.io",  # datasets' streaming patch of a local JSON builder imports it
    "torch.utils.tensorboard",  # --tracker tensorboard
    "matplotlib.figure",  # the pictures of analysis/ and benchmarks/ (Agg, no pyplot)
    "matplotlib.backends.backend_agg",
)

#: Environment variables read only at run time (rank variables, launchers', the project's): a
#: child may differ from the zygote in these and still start warm.
_RUNTIME_PREFIXES = (
    "TORCHELASTIC_",
    "TORCH_NCCL_",
    "TORCH_FR_",
    "NCCL_",
    "SLURM_",
    "PYTEST_",
    "LLAMA_",
    "MLFLOW_",
    "WANDB_",
)
_RUNTIME_NAMES = {
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",  # set again in the child (torch.set_num_threads)
    "PYTHONUNBUFFERED",  # stdio is rebuilt in the child
    "PYTHON_EXEC",  # read by torchrun when it starts workers
    "PYTHON",  # benchmarks/gpu_common.sh's interpreter (bash reads it, Python does not)
    # the launcher puts the venv's bin first; of the preloaded imports only tqdm looks at the
    # environment's names (for TQDM_*), none searches PATH
    "PATH",
    "TORCHINDUCTOR_CACHE_DIR",  # read by inductor when it compiles (cache_dir_utils)
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "KMP_DUPLICATE_LIB_OK",  # Intel OpenMP's, set by sklearn's import; torch's CPU build uses GNU's
}
#: Prefixes of variables some library reads at import (paths, caches, modes, threads, locale).
_IMPORT_PREFIXES = (
    "PYTHON",
    "HF_",
    "HUGGINGFACE",
    "TRANSFORMERS",
    "DATASETS",
    "TOKENIZERS",
    "TORCH",
    "PYTORCH",
    "CUDA",
    "NVTE",
    "LD_",
    "MKL",
    "KMP",
    "OMP",
    "GOMP",
    "OPENBLAS",
    "XDG_",
    "TQDM",
    "MPL",
    "LC_",
    "LANG",
    "HOME",
    "TMPDIR",
    "PATH",
    "MALLOC",  # glibc's malloc tunables, read when the process starts
    "GLIBC",
)


#: glibc's malloc tunables that ``mallopt`` sets in a running process as the variable would
#: have at its start (the threshold also fixed, not adapted): the child applies them itself.
_MALLOPT = {"MALLOC_MMAP_THRESHOLD_": -3}  # M_MMAP_THRESHOLD


def _apply_mallopt(env: dict[str, str]) -> None:
    """The child's malloc tunables of ``_MALLOPT`` (a memory test's: large allocations through
    mmap, so that RSS follows live memory), set as glibc sets them from the environment."""
    import ctypes

    libc = ctypes.CDLL(None)
    for name, param in _MALLOPT.items():
        if env.get(name, "").isdigit() and not libc.mallopt(param, int(env[name])):
            raise OSError(f"mallopt({name}={env[name]}) failed")


def import_time_env(env: dict[str, str]) -> dict[str, str]:
    """The variables of ``env`` that a library may have read while the zygote imported
    (PYTHONPATH is compared apart: :func:`shadows_preloaded`)."""
    return {
        k: v
        for k, v in env.items()
        if k.startswith(_IMPORT_PREFIXES)
        and k not in _RUNTIME_NAMES
        and k not in _MALLOPT
        and k != "PYTHONPATH"
        and not k.startswith(_RUNTIME_PREFIXES)
    }


def _entries(pythonpath: str | None) -> list[str]:
    return [os.path.abspath(p) for p in (pythonpath or "").split(os.pathsep) if p]


#: Top-level names the zygote has imported from its own paths; another folder that holds one of
#: these (a copy of the repository, say) must start cold to import its own.
_PRELOADED_TOPS = ("train.py", "te_llama.py", "model_utils", "torch", "transformers", "torchao")


def shadows_preloaded(pythonpath: str | None, zygote_pythonpath: str | None) -> bool:
    """Whether ``pythonpath`` adds a folder that would import a preloaded module from
    elsewhere."""
    known = set(_entries(zygote_pythonpath))
    for entry in _entries(pythonpath):
        if entry not in known and any(
            os.path.exists(os.path.join(entry, top)) for top in _PRELOADED_TOPS
        ):
            return True
    return False


# -- the stand-in ----------------------------------------------------------------------------

_FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGALRM,
    signal.SIGCONT,
)


def _recv_exact(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            return data
        data += chunk
    return data


def _wait_for(path: str) -> None:
    """Until the zygote's socket exists (it imports for ~10 s after the session starts), or
    the zygote is gone (OSError: start cold)."""
    import time

    pid = int(os.environ.get(PID_ENV) or 0)
    while not os.path.exists(path):
        if not pid:
            raise OSError("no zygote")
        with open(f"/proc/{pid}/stat") as f:  # FileNotFoundError once it is reaped
            if f.read().rpartition(")")[2].split()[0] in "ZX":
                raise OSError("the zygote died")
        time.sleep(0.05)


def client_main() -> None:
    """Run ``python ARGS`` in a child of the zygote and exit as it did (cold if not possible)."""
    args = sys.argv[1:]
    real = os.environ.get(REAL_PYTHON_ENV) or sys.executable
    path = os.environ.get(SOCKET_ENV)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if not path:
            raise OSError("no zygote")
        _wait_for(path)
        conn.connect(path)
    except OSError:
        os.execv(real, [real, *args])
    fds = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            fds.append(os.open(os.devnull, os.O_RDWR))
    request = json.dumps({"args": args, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    socket.send_fds(conn, [struct.pack("!I", len(request)) + request], fds)

    child = [0]
    pending: list[int] = []

    def forward(signum: int, frame: object) -> None:
        if child[0]:
            try:
                os.kill(child[0], signum)
            except ProcessLookupError:
                pass
        else:
            pending.append(signum)

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    status = None
    while True:
        message = _recv_exact(conn, 9)
        if len(message) < 9:
            break
        kind, value = message[:1], struct.unpack("!q", message[1:])[0]
        if kind == b"P":
            child[0] = value
            for signum in pending:
                forward(signum, None)
        else:
            status = value
            break
    if status is None:
        os.write(2, b"warm_start: the zygote went away before the process ended\n")
        os._exit(1)
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        for sig in _FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        os._exit(128 - code)
    os._exit(code)


def write_stand_in(folder: str, real_python: str) -> str:
    """An executable ``python`` in ``folder``: this module's source under a shebang of the real
    interpreter with ``-S`` (no site: it imports nothing but the standard library), so that run
    as a program it is the stand-in (:func:`main`)."""
    path = os.path.join(folder, "python")
    with open(__file__) as source, open(path, "w") as f:
        f.write(f"#!{real_python} -S\n" + source.read())
    os.chmod(path, 0o755)
    return path


# -- the zygote ------------------------------------------------------------------------------


def _parse(args: list[str]) -> tuple[dict, str, str, list[str]] | None:
    """Python's command line as (options, kind, target, rest); None where only a cold start can
    honour it. kind is "script", "module" or "code"."""
    options = {"unbuffered": False, "warnings": [], "faulthandler": False}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "-u":
            options["unbuffered"] = True
        elif arg == "-B":
            pass
        elif arg in ("-W", "-X") and i + 1 < len(args):
            value = args[i + 1]
            if arg == "-W":
                options["warnings"].append(value)
            elif value == "faulthandler":
                options["faulthandler"] = True
            else:
                return None
            i += 1
        elif arg in ("-m", "-c") and i + 1 < len(args):
            kind = "module" if arg == "-m" else "code"
            return options, kind, args[i + 1], args[i + 2 :]
        elif arg.startswith("-"):
            return None
        else:
            return options, "script", arg, args[i + 1 :]
        i += 1
    return None  # an interactive interpreter


def _stdio(unbuffered: bool) -> None:
    """New sys.stdin/stdout/stderr on fds 0-2, buffered as the interpreter would buffer them."""
    encoding = sys.stdout.encoding if sys.stdout else "utf-8"
    kept = (sys.stdin, sys.stdout, sys.stderr)  # never closed: their fds are the child's now
    _stdio.kept = kept  # type: ignore[attr-defined]

    def writer(fd: int, line_buffering: bool, errors: str) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        if unbuffered:
            return io.TextIOWrapper(raw, encoding, errors, write_through=True)
        return io.TextIOWrapper(io.BufferedWriter(raw), encoding, errors, line_buffering)

    stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding)
    sys.stdin = sys.__stdin__ = stdin
    sys.stdout = sys.__stdout__ = writer(1, os.isatty(1), "strict")
    sys.stderr = sys.__stderr__ = writer(2, True, "backslashreplace")


def _run_child(request: dict, fds: list[int], zygote_env: dict[str, str]) -> int:
    """Become the program of ``request`` (in the forked child); returns its exit status."""
    args, env = request["args"], request["env"]
    for target, fd in enumerate(fds):
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)
    os.chdir(request["cwd"])
    parsed = _parse(args)
    imports = request["set_by_imports"]
    mine, zygotes = import_time_env({**imports, **env}), import_time_env({**imports, **zygote_env})
    differing = {k for k in {**mine, **zygotes} if mine.get(k) != zygotes.get(k)}
    if shadows_preloaded(env.get("PYTHONPATH"), zygote_env.get("PYTHONPATH")):
        differing.add("PYTHONPATH")
    if parsed is None or differing:
        real = env.get(REAL_PYTHON_ENV) or sys.executable
        _log_cold(args, differing)
        os.execve(real, [real, *args], env)
    options, kind, target, rest = parsed
    os.environ.clear()
    os.environ.update({**imports, **env})
    _apply_mallopt(env)
    _stdio(options["unbuffered"] or bool(env.get("PYTHONUNBUFFERED")))
    import warnings

    for spec in options["warnings"]:
        warnings._setoption(spec)  # as the interpreter's -W does
    if options["faulthandler"]:
        import faulthandler

        faulthandler.enable()
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        # The pool's threads inherit this mask: with every signal blocked there, a signal sent
        # to the process reaches the main thread, as in a cold program that has no pool yet
        # (one taken by a pool thread leaves a sleeping main thread asleep, its handler unrun).
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        try:
            torch.set_num_threads(int(threads))
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    base = [p for p in sys.path[1:] if p not in _entries(zygote_env.get("PYTHONPATH"))]
    sys.path[:] = ["", *_entries(env.get("PYTHONPATH")), *base]  # [0] set by _run_main
    return _run_main(kind, target, rest)


def _log_cold(args: list[str], differing: set[str]) -> None:
    """One line per cold start in ``$LLAMA_TEST_WARM_LOG`` (the zygote's), for the accounting of
    which tests still start cold and why."""
    log = os.environ.get(LOG_ENV)
    if log:
        line = json.dumps(
            {
                "args": args[:4],
                "env": sorted(differing),
                "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
            }
        )
        with open(log, "a") as f:
            f.write(line + "\n")


def _run_main(kind: str, target: str, rest: list[str]) -> int:
    """The program as ``__main__``, ended as the interpreter ends one (SystemExit's code, a
    traceback and 1, or a KeyboardInterrupt re-raised as SIGINT)."""
    import runpy

    try:
        if kind == "script":
            sys.argv = [target, *rest]
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
        elif kind == "module":
            sys.argv = ["-m", *rest]  # runpy puts the module's file in argv[0]
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *rest]
            sys.path[0] = ""
            import types

            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(target, "<string>", "exec"), main.__dict__)
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def _send(conn: socket.socket, kind: bytes, value: int) -> None:
    try:
        conn.sendall(kind + struct.pack("!q", value))
    except OSError:
        pass  # the stand-in is gone: nobody waits for this process any more


def serve(path: str) -> tuple[dict, list[int]] | None:
    """Import PRELOAD, then fork a child per request until stdin closes (the test session's end).

    Returns (request, fds) in a forked child, None in the zygote when it is done."""
    import gc
    import importlib
    import selectors
    import threading

    zygote_env = dict(os.environ)  # as it started: what the imports saw
    for name in PRELOAD:
        importlib.import_module(name)
    assert threading.active_count() == 1, f"a preloaded import started {threading.enumerate()}"
    # A child's cyclic collector never walks the preloaded objects: each full collection did,
    # writing their headers and so copying their pages (test_failures_processes.py, alone:
    # 103 -> 73 CPU s).
    gc.collect()
    gc.freeze()
    # what the imports set (e.g. TORCHINDUCTOR_CACHE_DIR): a cold start would set it too
    set_by_imports = {k: v for k, v in os.environ.items() if k not in zygote_env}

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(128)
    os.rename(path + ".tmp", path)  # the name appears once the zygote answers
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "reap")
    selector.register(sys.stdin, selectors.EVENT_READ, "stop")
    children: dict[int, socket.socket] = {}  # pid -> the stand-in's connection

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = children.pop(pid, None)
            if conn is not None:
                _send(conn, b"S", status)
                if conn.fileno() in selector.get_map():
                    selector.unregister(conn)
                conn.close()

    while True:
        for key, _ in selector.select():
            if key.data == "stop":
                return None
            if key.data == "reap":
                while True:
                    try:
                        if not os.read(wake_r, 4096):
                            break
                    except BlockingIOError:
                        break
                reap()
            elif key.data == "accept":
                conn, _ = listener.accept()
                try:
                    head, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
                    size = struct.unpack("!I", head[:4])[0]
                    body = head[4:] + _recv_exact(conn, size - (len(head) - 4))
                    request = json.loads(body)
                except (OSError, ValueError, struct.error):
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    for fd in (wake_r, wake_w):
                        os.close(fd)
                    signal.set_wakeup_fd(-1)
                    listener.close()
                    conn.close()
                    for other in children.values():
                        other.close()
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python starts
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    os.setsid()
                    request["zygote_env"] = zygote_env
                    request["set_by_imports"] = set_by_imports
                    return request, fds
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                selector.register(conn, selectors.EVENT_READ, pid)
                _send(conn, b"P", pid)
            else:  # the stand-in's connection: data or EOF before the status means it died
                try:
                    alive = key.fileobj.recv(1)
                except OSError:
                    alive = b""
                if not alive:
                    selector.unregister(key.fileobj)
                    try:
                        os.kill(key.data, signal.SIGKILL)
                    except ProcessLookupError:
                        pass


def zygote_main(path: str) -> None:
    child = serve(path)
    if child is None:
        os.unlink(path)
        return
    request, fds = child
    sys.exit(_run_child(request, fds, request.pop("zygote_env")))


def main() -> None:
    """``warm_start.py --zygote SOCKET`` serves; the stand-in (any other arguments) asks."""
    if sys.argv[1:2] == ["--zygote"]:
        zygote_main(sys.argv[2])
    else:
        client_main()


if __name__ == "__main__":
    main()
