"""One cuDNN per process: make Transformer Engine load the libcudnn torch already runs on.

TE loads cuDNN itself when it is imported (``transformer_engine/common/__init__.py``,
``_load_cuda_library``): it searches ``CUDNN_HOME``, ``CUDNN_PATH``, ``CUDA_HOME``, ``CUDA_PATH``
and ``/usr/local/cuda`` before pip's copy, and opens what it finds with ``RTLD_GLOBAL``. With
torch from PyPI, torch's cuDNN is pip's (``nvidia/.../libcudnn.so.9``, opened ``RTLD_LOCAL``), so
on a machine with a CUDA toolkit TE opens a second, often older, cuDNN, and its symbols then
answer torch's own cuDNN calls too. Seen on an H100 (torch 2.11+cu130, TE 2.20.2): TE ran on the
toolkit's 9.14 while torch was built on 9.19, torch's ``cudnn.version()`` raised a version
mismatch, and deterministic FP8 attention (which needs 9.19) was refused.

Pointing ``CUDNN_HOME`` at the folder of torch's libcudnn, before the import, makes TE's search
find that same file (the loader then hands back the library already open). Nothing is changed
when the user chose a cuDNN (``CUDNN_HOME`` or ``CUDNN_PATH`` set), when TE is already imported,
when torch opened no cuDNN (CPU builds), or when TE's search in that folder would pick another
file. The NGC image has a single cuDNN: there TE's choice and torch's are already one file,
and the variable changes nothing.
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

#: TE's loader reads these before CUDA_HOME (``f"{lib_name.upper()}_HOME"``, ``..._PATH``); a
#: user who set either has chosen TE's cuDNN.
CUDNN_CHOICE_VARIABLES = ("CUDNN_HOME", "CUDNN_PATH")
#: The file name TE's loader globs for (``lib{lib_name}.so*``): libcudnn_graph.so.9 and the other
#: sub-libraries do not match it.
CUDNN_LIBRARY = "libcudnn.so"


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


def cudnn_home_for_te(
    environ: MutableMapping[str, str], maps: str, te_imported: bool
) -> str | None:
    """The folder to set ``CUDNN_HOME`` to so TE opens the libcudnn torch has open, or None."""
    if te_imported or any(environ.get(name) for name in CUDNN_CHOICE_VARIABLES):
        return None
    torch_cudnn = mapped_cudnn(maps)
    if torch_cudnn is None:
        return None
    folder = str(Path(torch_cudnn).parent)
    pick = te_cudnn_pick(folder)
    try:
        same = pick is not None and os.path.samefile(pick, torch_cudnn)
    except OSError:  # the mapped file is gone (upgraded underneath the process)
        same = False
    return folder if same else None


def align_te_cudnn() -> str | None:
    """Set ``CUDNN_HOME`` for TE's loader (see the module docstring); the folder set, or None.

    Called by every TE import in the project, before it. Child processes inherit the variable,
    which is what they need too: they import the same torch.
    """
    if "transformer_engine" in sys.modules:  # every later import: TE's cuDNN is loaded for good
        return None
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux: no TE build either
        return None
    folder = cudnn_home_for_te(os.environ, maps, te_imported=False)
    if folder is not None:
        os.environ["CUDNN_HOME"] = folder
    return folder
