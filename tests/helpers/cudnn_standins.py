"""Small real shared libraries laid out like cuDNN, for tests of which cuDNN a process loads.

cuDNN 9 is a front library (``libcudnn.so.9``) and sub-libraries it and its users need by
soname: ``libcudnn_graph.so.9``, and ``libcudnn_heuristic.so.9`` that needs the graph library.
Each stand-in reports its family's version through the chain, so a test sees which family
answered a call, the way the H100 showed TE's core library reaching Debian's 9.14 heuristic
library while torch ran on pip's 9.19. Built with the system C compiler (the test machines have
one); a test skips where there is none.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

#: (library, soname it needs, C source); ``{version}`` is the family's encoded version.
_LIBRARIES = (
    ("libcudnn_graph.so.9", None, "int cudnn_graph_version(void) {{ return {version}; }}"),
    (
        "libcudnn_heuristic.so.9",
        "libcudnn_graph.so.9",
        "int cudnn_graph_version(void);\n"
        "int cudnn_heuristic_version(void) {{ return cudnn_graph_version(); }}",
    ),
    ("libcudnn.so.9", None, "int cudnnGetVersion(void) {{ return {version}; }}"),
)

#: A stand-in for TE's core library (``libtransformer_engine.so``): it needs a cuDNN
#: sub-library by soname and has no search path of its own to find it.
_CORE = (
    "int cudnn_heuristic_version(void);\n"
    "int core_cudnn_version(void) { return cudnn_heuristic_version(); }"
)


def compiler() -> str:
    found = shutil.which("cc") or shutil.which("gcc")
    if found is None:
        pytest.skip("no C compiler to build cuDNN stand-ins")
    return found


def _compile(source: str, out: Path, *flags: str) -> None:
    c_file = out.with_name(out.name + ".c")
    c_file.write_text(source + "\n")
    command = [compiler(), "-shared", "-fPIC", "-o", str(out), str(c_file), *flags]
    subprocess.run(command, check=True, capture_output=True, text=True)
    c_file.unlink()


def build_cudnn_family(folder: Path, version: int, origin_runpath: bool) -> Path:
    """A cuDNN family in ``folder``. ``origin_runpath``: its libraries find each other in their
    own folder (pip's wheels set ``$ORIGIN``); without it they rely on the library path, as a
    system install does. A ``libcudnn.so`` link is there too (the system package's)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, needs, source in _LIBRARIES:
        flags = [f"-Wl,-soname,{name}"]
        if needs:
            flags += [f"-L{folder}", f"-l:{needs}"]
        if origin_runpath:
            flags += ["-Wl,--enable-new-dtags,-rpath,$ORIGIN"]
        _compile(source.format(version=version), folder / name, *flags)
    (folder / "libcudnn.so").symlink_to("libcudnn.so.9")
    return folder


def build_core(out: Path, link_against: Path) -> Path:
    """TE's core library stand-in, linked against the heuristic library in ``link_against``
    (only to name the soname it needs; no search path is recorded)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    _compile(
        _CORE,
        out,
        f"-L{link_against}",
        "-l:libcudnn_heuristic.so.9",
        f"-Wl,-rpath-link,{link_against}",
    )
    return out
