"""The extension opens the CUDA kernels library only when its one export, the entry table, is the one this build
made: a table of another version or layout, or a library without one, is refused with UnsupportedError naming the
library, and nothing in it is called. Checked on a copy of the package whose library is altered, in a child
process (loading the library is what is tested, and this process should not carry it). No GPU needed.

An installed build without the kernels (the default where no GPU was visible at build time) is checked on a copy
built here with HEXISEQ_CUDA=1 for one architecture: that nvcc build takes minutes, so those tests are in the slow
tier (`pytest --tier slow`)."""

import os
import shutil
import struct
import subprocess
import sys

import pytest

import hexiseq

INSTALLED = os.path.dirname(os.path.abspath(hexiseq.__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILT = hexiseq.build_info()["cuda"]
pytestmark = [] if BUILT else [pytest.mark.slow]


def find_nvcc():
    for cand in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if cand and os.path.isfile(os.path.join(cand, "bin", "nvcc")):
            return os.path.join(cand, "bin", "nvcc")
    return shutil.which("nvcc")


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """The package directory whose libhexiseq_cuda.so is tested: the installed one when it has the kernels, else
    one built from the source tree with HEXISEQ_CUDA=1 (the C extension and the kernels for sm_80 only)."""
    if BUILT:
        return INSTALLED
    if not os.path.isfile(os.path.join(ROOT, "setup.py")) or find_nvcc() is None:
        pytest.skip("hexiseq was built without CUDA kernels, and nvcc or the source tree is missing to build them")
    out = tmp_path_factory.mktemp("cuda_build")
    env = dict(os.environ, HEXISEQ_CUDA="1", HEXISEQ_CUDA_ARCHS="80")
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "-b", str(out / "lib"), "-t",
                        str(out / "tmp")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-6000:]
    dst = out / "lib" / "hexiseq"
    shutil.copytree(INSTALLED, dst, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.c", "*.h", "*.so"))
    return str(dst)


def test_built_copy_reports_its_kernels(package, tmp_path):
    code = "import hexiseq, json; print(json.dumps(hexiseq.build_info()))"
    env = dict(os.environ, PYTHONPATH=os.path.dirname(package))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                       cwd=os.path.dirname(package))
    assert r.returncode == 0, r.stderr
    import json
    info = json.loads(r.stdout)
    assert info["cuda"] and info["cuda_runtime"] > 0 and info["cuda_archs"] and not info["cuda_skipped"], info
SYMBOL = b"hexiseq_cuda_entry_table"
# The table's head as kernels/launch.h lays it out: version 3, then its size (4 uint32 and 5 function pointers).
HEAD = struct.pack("<II", 3, 4 * 4 + 5 * 8)


def child(package_parent):
    """Load the package at `package_parent` in a fresh interpreter and ask for the CUDA devices."""
    code = ("import hexiseq\n"
            "print(hexiseq.__file__)\n"
            "try:\n"
            "    print('devices', hexiseq.cuda_device_count())\n"
            "except hexiseq.HexiseqError as e:\n"
            "    print(type(e).__name__, e)\n")
    env = dict(os.environ, PYTHONPATH=str(package_parent))
    # run from there too: `python -c` puts the working directory first on sys.path, ahead of PYTHONPATH
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                       cwd=package_parent)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"{package_parent}{os.sep}hexiseq{os.sep}"), r.stdout
    return r.stdout.split("\n", 1)[1].strip()


def copy_package(package, tmp_path, alter):
    dst = tmp_path / "hexiseq"
    shutil.copytree(package, dst, ignore=shutil.ignore_patterns("__pycache__", "*.c", "*.h"))
    lib = dst / "libhexiseq_cuda.so"
    data = bytearray(lib.read_bytes())
    alter(data)
    lib.write_bytes(bytes(data))
    return tmp_path


def table_offset(data) -> int:
    """File offset of the entry table in the library (a little-endian ELF64 shared object): its symbol's address in
    the dynamic symbol table, mapped through the section that holds it. Read from the symbol, not found by searching
    for the table's bytes, which the kernels' own sections may happen to contain too."""
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not a little-endian ELF64 file"
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    # (type, addr, offset, size, link, entsize) of each section header
    sections = [struct.unpack_from("<4xI8xQQQI12xQ", data, shoff + i * shentsize) for i in range(shnum)]
    SHT_DYNSYM = 11
    _, _, symoff, symsize, strndx, symentsize = next(h for h in sections if h[0] == SHT_DYNSYM)
    stroff = sections[strndx][2]
    for at in range(symoff, symoff + symsize, symentsize):
        name_at, = struct.unpack_from("<I", data, at)
        name = data[stroff + name_at:data.index(b"\0", stroff + name_at)]
        if name == SYMBOL:
            value, = struct.unpack_from("<Q", data, at + 8)
            _, addr, offset, size, _, _ = next(h for h in sections if h[1] <= value < h[1] + h[3] and h[1])
            at = value - addr + offset
            assert data[at:at + len(HEAD)] == HEAD, "the table's head is not the one this test knows"
            return at
    raise AssertionError(f"{SYMBOL!r} is not in the dynamic symbol table")


def test_unaltered_copy_loads(package, tmp_path):
    out = child(copy_package(package, tmp_path, lambda data: None))
    assert out.startswith("devices "), out


@pytest.mark.parametrize("field", ["version", "size"])
def test_table_from_another_build_is_refused(package, tmp_path, field):
    def alter(data):
        at = table_offset(data) + (0 if field == "version" else 4)
        data[at:at + 4] = struct.pack("<I", 99)

    out = child(copy_package(package, tmp_path, alter))
    assert out.startswith("UnsupportedError"), out
    assert "libhexiseq_cuda.so is from another build" in out and "rebuild hexiseq" in out, out


def test_library_without_the_table_is_refused(package, tmp_path):
    def alter(data):
        # the symbol's name, in the dynamic string table and the static one: renamed, dlsym no longer finds it
        name = SYMBOL + b"\0"
        assert data.count(name) >= 1
        data[:] = data.replace(name, SYMBOL[:-1] + b"X\0")

    out = child(copy_package(package, tmp_path, alter))
    assert out.startswith("UnsupportedError"), out
    assert "has no hexiseq_cuda_entry_table" in out, out
