"""How Transformer Engine is loaded: on the libcudnn torch already runs on (one cuDNN per
process), by one importer with one error (``import_te``, ``TEUnavailableError``).

Part of the config stage because ``--model_impl auto`` asks, while the flags are resolved,
whether TE imports here (``te_available``); the precision and model stages import TE through it.

TE loads cuDNN itself when it is imported (``transformer_engine/common/__init__.py``,
``_load_cuda_library``): it searches ``CUDNN_HOME``, ``CUDNN_PATH``, ``CUDA_HOME``, ``CUDA_PATH``
and ``/usr/local/cuda``, then the system's library path, all before pip's copy, and opens what it
finds with ``RTLD_GLOBAL``. With torch from PyPI, torch's cuDNN is pip's (``nvidia/cudnn/lib``),
so on a machine with another cuDNN installed TE opens that one, and its symbols then answer
torch's own cuDNN calls too: torch's ``cudnn.version()`` raises a version mismatch, and what
needs torch's newer cuDNN (deterministic FP8 attention) is refused (docs/failures.md, "Where the
rules came from").

Two things make TE run on torch's cuDNN, both before TE's import:

1. ``CUDNN_HOME`` points at the folder of torch's libcudnn, so TE's search finds that same file
   (the dynamic loader hands back the library already open).
2. The cuDNN sub-libraries in that folder (``libcudnn_graph``, ``libcudnn_heuristic``, the
   engines) are opened by path, as TE itself does where no CUDA toolkit is installed. TE's core
   library needs them by soname; a soname nothing has open yet is looked up on the system's
   library path, where the other cuDNN answers, and that sub-library then fails on torch's
   (undefined symbol): step 1 alone is not enough. Opened here first, every such soname is taken
   by torch's file.

Nothing is changed when the user chose another cuDNN (``CUDNN_HOME`` or ``CUDNN_PATH`` set to
another folder), when TE is already imported, when torch opened no cuDNN (CPU builds), or when
TE's search in that folder would pick another file. The NGC image has a single cuDNN: there
TE's choice and torch's are already one file, and the alignment changes nothing.
"""

from __future__ import annotations

import ctypes
import glob
import importlib
import os
import sys
from collections.abc import MutableMapping
from pathlib import Path
from types import ModuleType

#: TE's loader reads these before CUDA_HOME (``f"{lib_name.upper()}_HOME"``, ``..._PATH``); a
#: user who set either to another folder than torch's has chosen TE's cuDNN.
CUDNN_CHOICE_VARIABLES = ("CUDNN_HOME", "CUDNN_PATH")
#: The file name TE's loader globs for (``lib{lib_name}.so*``): libcudnn_graph.so.9 and the other
#: sub-libraries do not match it.
CUDNN_LIBRARY = "libcudnn.so"
#: The sub-libraries TE opens from pip's cuDNN folder where no toolkit is installed
#: (``_load_cuda_library_from_python``: ``lib*.so.*[0-9]``), the graph library first: the
#: others need it.
CUDNN_SUBLIBRARIES = "libcudnn_*.so.*[0-9]"
CUDNN_GRAPH = "libcudnn_graph"


def mapped_cudnn(maps: str) -> str | None:
    """The libcudnn this process has open, from a ``/proc/<pid>/maps`` text (None: none)."""
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
        if len(fields) == 6 and Path(fields[5]).name.startswith(CUDNN_LIBRARY):
            return fields[5]
    return None


def te_cudnn_pick(folder: str) -> str | None:
    """The libcudnn TE's loader takes when it searches ``folder``: its glob, without stubs, the
    highest file name first (TE 2.16 to 2.20, ``_load_cuda_library_from_system``)."""
    found = glob.glob(f"{folder}/**/{CUDNN_LIBRARY}*", recursive=True)
    found = [path for path in found if "stub" not in path]
    found.sort(reverse=True, key=os.path.basename)
    return found[0] if found else None


def cudnn_sublibraries(folder: str) -> list[str]:
    """The cuDNN sub-libraries in ``folder`` in the order to open them: the graph library first
    (the heuristic and engine libraries need it), then by name."""
    found = glob.glob(os.path.join(glob.escape(folder), CUDNN_SUBLIBRARIES))
    return sorted(found, key=lambda path: (not Path(path).name.startswith(CUDNN_GRAPH), path))


def chosen_cudnn_folder(environ: MutableMapping[str, str]) -> str | None:
    """The folder a cuDNN was chosen in (TE reads ``CUDNN_HOME``, then ``CUDNN_PATH``), or None."""
    return next((environ[name] for name in CUDNN_CHOICE_VARIABLES if environ.get(name)), None)


def same_path(a: str, b: str) -> bool:
    """Whether two paths name one file or folder (False where either is gone)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def cudnn_home_for_te(
    environ: MutableMapping[str, str], maps: str, te_imported: bool
) -> str | None:
    """The folder of the libcudnn torch has open, for ``CUDNN_HOME``, when TE's search there
    picks that same file; None to leave TE alone.

    A chosen folder that is torch's own (a child process inherits the variable from a parent
    that aligned) still gets the folder: the child must open the sub-libraries too.
    """
    torch_cudnn = mapped_cudnn(maps)
    if te_imported or torch_cudnn is None:
        return None
    folder = str(Path(torch_cudnn).parent)
    chosen = chosen_cudnn_folder(environ)
    if chosen is not None and not same_path(chosen, folder):
        return None
    pick = te_cudnn_pick(folder)
    # a mapped file that is gone (upgraded underneath the process) is the same as nothing
    return folder if pick is not None and same_path(pick, torch_cudnn) else None


def align_te_cudnn() -> str | None:
    """Set ``CUDNN_HOME`` for TE's loader and open torch's cuDNN sub-libraries (see the module
    docstring); the folder set, or None.

    Called by every TE import in the project, before it. Child processes inherit the variable
    and make the same call: they import the same torch.
    """
    if "transformer_engine" in sys.modules:  # every later import: TE's cuDNN is loaded for good
        return None
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux: no TE build either
        return None
    folder = cudnn_home_for_te(os.environ, maps, te_imported=False)
    if folder is None:
        return None
    os.environ["CUDNN_HOME"] = folder
    for library in cudnn_sublibraries(folder):
        try:
            ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
        except OSError as err:
            raise OSError(
                f"opening torch's cuDNN library {library} for TE failed ({err}); "
                "choose TE's cuDNN with CUDNN_HOME"
            ) from err
    return folder


class TEUnavailableError(ImportError):
    """Transformer Engine is not importable here (it needs an NVIDIA GPU build, e.g. NGC)."""


def import_te() -> ModuleType:
    """Return ``transformer_engine.pytorch`` or raise a one-line, actionable error.

    TE is first pointed at the cuDNN torch runs on (:func:`align_te_cudnn`): it loads its own
    at import.
    """
    try:
        align_te_cudnn()
        return importlib.import_module("transformer_engine.pytorch")
    # OSError: TE opens its CUDA libraries with ctypes, which raises it (e.g. a system cuDNN
    # sub-library that does not match the cuDNN already open: "undefined symbol")
    except (ImportError, OSError) as err:
        raise TEUnavailableError(
            "Transformer Engine is not available (import transformer_engine.pytorch failed: "
            f"{err}). Use --model_impl hf, or run inside the NGC PyTorch container built by "
            "0.transformer-engine.dockerfile."
        ) from err


def te_available() -> bool:
    """True when ``transformer_engine.pytorch`` imports (used by ``--model_impl auto``)."""
    try:
        import_te()
    except TEUnavailableError:
        return False
    return True
