"""te_loader: TE is pointed at the libcudnn torch has open, so a process runs one cuDNN.

TE's own loader, run from each supported release's source against real shared objects, is in
tests/integration/test_te_contract.py; here are the rules and the wiring into every TE import.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from te_double import subprocess_env

from model_utils.config import te_loader

ROOT = Path(__file__).resolve().parents[2]


def maps_line(path: str | Path, address: str = "7f00a0000000-7f00a0200000") -> str:
    """A ``/proc/<pid>/maps`` line for a file-backed mapping of ``path``."""
    return f"{address} r-xp 00000000 08:01 4242                       {path}"


def pip_cudnn(root: Path) -> Path:
    """Where torch from PyPI keeps its cuDNN (``nvidia/cudnn/lib``), as an empty file."""
    lib = root / "site-packages" / "nvidia" / "cudnn" / "lib" / "libcudnn.so.9"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    return lib


def real_shared_object() -> Path:
    """A small real shared library (zlib: no dependency but libc, no initialisers) to stand in
    for libcudnn where a test opens it with ``dlopen``."""
    for pattern in ("/lib/*/libz.so.1", "/usr/lib/*/libz.so.1", "/lib64/libz.so.1"):
        for candidate in sorted(Path("/").glob(pattern.lstrip("/"))):
            return candidate.resolve()
    pytest.skip("no libz.so.1 to stand in for libcudnn")


def test_the_main_library_is_found_not_its_sub_libraries(tmp_path) -> None:
    folder = tmp_path / "a folder with spaces" / "lib"
    maps = "\n".join(
        [
            maps_line("/usr/lib/libc.so.6"),
            maps_line(folder / "libcudnn_graph.so.9"),
            "7f00a0400000-7f00a0600000 rw-p 00000000 00:00 0 ",
            maps_line(folder / "libcudnn.so.9"),
        ]
    )
    assert te_loader.mapped_cudnn(maps) == str(folder / "libcudnn.so.9")
    assert te_loader.mapped_cudnn(maps_line("/usr/lib/libcudnn_ops.so.9")) is None


def test_te_is_pointed_at_the_folder_of_torchs_cudnn(tmp_path) -> None:
    lib = pip_cudnn(tmp_path)
    assert te_loader.cudnn_home_for_te({}, maps_line(lib), te_imported=False) == str(lib.parent)


@pytest.mark.parametrize(
    ("environ", "te_imported"),
    [({"CUDNN_HOME": "/opt/cudnn"}, False), ({"CUDNN_PATH": "/opt/cudnn"}, False), ({}, True)],
    ids=["CUDNN_HOME", "CUDNN_PATH", "te-imported"],
)
def test_a_users_choice_or_an_imported_te_is_left_alone(tmp_path, environ, te_imported) -> None:
    """The user chose TE's cuDNN; or TE has loaded one already and a variable changes nothing."""
    lib = pip_cudnn(tmp_path)
    assert te_loader.cudnn_home_for_te(environ, maps_line(lib), te_imported) is None


@pytest.mark.parametrize("variable", ["CUDNN_HOME", "CUDNN_PATH"])
def test_a_choice_of_torchs_own_folder_is_aligned_again(tmp_path, variable) -> None:
    """A child process inherits the ``CUDNN_HOME`` its parent set: the folder is torch's, so
    the child aligns too (it must open the sub-libraries itself)."""
    lib = pip_cudnn(tmp_path)
    environ = {variable: str(lib.parent)}
    assert te_loader.cudnn_home_for_te(environ, maps_line(lib), te_imported=False) == str(
        lib.parent
    )


def test_the_sub_libraries_open_graph_first_and_the_front_library_is_not_among_them(
    tmp_path,
) -> None:
    """TE's no-toolkit pattern (``lib*.so.*[0-9]``) for the sub-libraries: versioned files
    only; the graph library first, since the heuristic and engine libraries need it."""
    lib = pip_cudnn(tmp_path)
    for name in (
        "libcudnn_adv.so.9",
        "libcudnn_engines_precompiled.so.9",
        "libcudnn_graph.so.9",
        "libcudnn_heuristic.so.9",
        "libcudnn_ops.so",
    ):
        (lib.parent / name).write_bytes(b"")
    assert [Path(p).name for p in te_loader.cudnn_sublibraries(str(lib.parent))] == [
        "libcudnn_graph.so.9",
        "libcudnn_adv.so.9",
        "libcudnn_engines_precompiled.so.9",
        "libcudnn_heuristic.so.9",
    ]


def test_without_a_cudnn_in_the_process_nothing_changes() -> None:
    """CPU torch opens no cuDNN: this very process (the test machine has no GPU build)."""
    maps = Path("/proc/self/maps").read_text()
    assert te_loader.mapped_cudnn(maps) is None
    assert te_loader.cudnn_home_for_te({}, maps, te_imported=False) is None


def test_a_folder_where_te_would_pick_another_cudnn_is_not_used(tmp_path) -> None:
    """TE takes the highest file name its glob finds: a second cuDNN beside torch's would win."""
    lib = pip_cudnn(tmp_path)
    (lib.parent / "libcudnn.so.9.20.0").write_bytes(b"another")
    assert te_loader.te_cudnn_pick(str(lib.parent)) == str(lib.parent / "libcudnn.so.9.20.0")
    assert te_loader.cudnn_home_for_te({}, maps_line(lib), te_imported=False) is None


def test_a_versioned_file_behind_a_symlink_is_the_same_cudnn(tmp_path) -> None:
    """A system layout: libcudnn.so.9 -> libcudnn.so.9.19.0; the process maps the target, TE's
    glob sees both names, and either opens the same file."""
    folder = tmp_path / "lib64"
    folder.mkdir()
    (folder / "libcudnn.so.9.19.0").write_bytes(b"")
    (folder / "libcudnn.so.9").symlink_to("libcudnn.so.9.19.0")
    maps = maps_line(folder / "libcudnn.so.9.19.0")
    assert te_loader.cudnn_home_for_te({}, maps, te_imported=False) == str(folder)


def test_a_mapped_file_that_was_replaced_is_not_used(tmp_path) -> None:
    lib = pip_cudnn(tmp_path)
    maps = maps_line(f"{lib} (deleted)")
    assert te_loader.cudnn_home_for_te({}, maps, te_imported=False) is None


@pytest.mark.parametrize("te_import", ["te_loader.import_te", "te_precision.import_recipe_module"])
def test_every_te_import_first_points_te_at_torchs_cudnn(tmp_path, te_import) -> None:
    """In a fresh process that opened a libcudnn the way torch from PyPI does (``dlopen``,
    RTLD_LOCAL), importing TE (the double) through the project sets ``CUDNN_HOME`` to its folder
    and opens the sub-libraries there first, and the start-up line names it; a child's
    inherited ``CUDNN_HOME`` (torch's folder) does the same; a user's other folder is kept and
    nothing is opened."""
    lib = tmp_path / "site-packages" / "nvidia" / "cudnn" / "lib" / "libcudnn.so.9"
    lib.parent.mkdir(parents=True)
    shutil.copy(real_shared_object(), lib)
    shutil.copy(real_shared_object(), lib.parent / "libcudnn_graph.so.9")
    script = textwrap.dedent(
        f"""
        import ctypes, os, sys
        ctypes.CDLL({str(lib)!r})
        from model_utils.config import te_loader
        from model_utils.precision import te as te_precision
        {te_import}()
        print("CUDNN_HOME=" + os.environ.get("CUDNN_HOME", ""))
        print("describe=" + te_precision._describe_cudnn())
        maps = open("/proc/self/maps").read()
        print("graph=" + str("libcudnn_graph.so.9" in maps))
        """
    )

    def run(environ: dict[str, str]) -> dict[str, str]:
        env = subprocess_env({k: v for k, v in os.environ.items() if "CUDNN" not in k} | environ)
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        ).stdout
        return dict(re.findall(r"^(\w+)=(.*)$", out, flags=re.MULTILINE))

    aligned = run({})
    assert aligned["CUDNN_HOME"] == str(lib.parent) and aligned["graph"] == "True"
    assert aligned["describe"] == f"; TE's cuDNN 9.19.0 from {lib.parent}"
    assert run({"CUDNN_HOME": str(lib.parent)})["graph"] == "True"
    chosen = run({"CUDNN_HOME": "/opt/cudnn"})
    assert chosen["CUDNN_HOME"] == "/opt/cudnn" and chosen["graph"] == "False"


def test_a_cudnn_library_that_cannot_be_opened_makes_te_unavailable_in_one_line(tmp_path) -> None:
    """A broken file beside torch's libcudnn: the TE import fails with one line naming it (and
    ``--model_impl auto`` falls back to hf), not with a ctypes traceback."""
    lib = tmp_path / "site-packages" / "nvidia" / "cudnn" / "lib" / "libcudnn.so.9"
    lib.parent.mkdir(parents=True)
    shutil.copy(real_shared_object(), lib)
    (lib.parent / "libcudnn_graph.so.9").write_bytes(b"not a shared object")
    script = textwrap.dedent(
        f"""
        import ctypes, sys
        ctypes.CDLL({str(lib)!r})
        from model_utils.config import te_loader
        try:
            te_loader.import_te()
        except te_loader.TEUnavailableError as err:
            print(err)
        """
    )
    env = subprocess_env({k: v for k, v in os.environ.items() if "CUDNN" not in k})
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert len(out.splitlines()) == 1, out
    assert str(lib.parent / "libcudnn_graph.so.9") in out and "CUDNN_HOME" in out, out
    assert out.startswith("Transformer Engine is not available"), out
