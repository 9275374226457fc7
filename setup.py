"""Build of the hexiseq C extension: the C core in csrc/, the binding, and, when nvcc is found, the CUDA
kernels in kernels/. Set HEXISEQ_CUDA=0 to skip CUDA, HEXISEQ_CUDA_ARCHS="80;90a" to choose targets."""

import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

import numpy
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


def read_version():
    with open(os.path.join(HERE, "csrc", "hexiseq.h")) as f:
        return re.search(r'#define HEXISEQ_VERSION "([^"]+)"', f.read()).group(1)


def find_nvcc():
    if os.environ.get("HEXISEQ_CUDA", "1") == "0":
        return None
    for cand in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if cand and os.path.isfile(os.path.join(cand, "bin", "nvcc")):
            return os.path.join(cand, "bin", "nvcc")
    return shutil.which("nvcc")


def compiler_accepts(compiler, flag):
    """True when the C compiler builds and links a tiny OpenMP program with `flag`."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "t.c")
        with open(src, "w") as f:
            f.write("#include <omp.h>\nint main(void) { return omp_get_max_threads() > 0 ? 0 : 1; }\n")
        cmd = list(compiler) + [flag, src, "-o", os.path.join(tmp, "t")]
        return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


class BuildExt(build_ext):
    def build_extensions(self):
        ext = self.extensions[0]
        cc = self.compiler.compiler_so[:1]
        if compiler_accepts(cc, "-fopenmp"):
            ext.extra_compile_args.append("-fopenmp")
            ext.extra_link_args.append("-fopenmp")
        else:
            print("hexiseq: the C compiler has no OpenMP; CPU kernels will use one core", file=sys.stderr)
        nvcc = find_nvcc()
        cu_sources = sorted(glob.glob(os.path.join("kernels", "*.cu")))
        if nvcc and cu_sources:
            self.build_cuda(ext, nvcc, cu_sources)
        else:
            print("hexiseq: warning: nvcc not found (or HEXISEQ_CUDA=0); building the CPU-only extension",
                  file=sys.stderr)
        super().build_extensions()

    def build_cuda(self, ext, nvcc, sources):
        archs = os.environ.get("HEXISEQ_CUDA_ARCHS", "80;90").split(";")
        gencode = []
        for a in archs:
            a = a.strip()
            if a:
                gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
        cuda_home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        objdir = os.path.join(self.build_temp, "kernels")
        os.makedirs(objdir, exist_ok=True)
        for src in sources:
            obj = os.path.join(objdir, os.path.basename(src) + ".o")
            cmd = [nvcc, "-c", src, "-o", obj, "-O3", "-std=c++17", "-Xcompiler", "-fPIC,-fvisibility=hidden",
                   "-Icsrc", "-Ikernels", "--expt-relaxed-constexpr", "-lineinfo"] + gencode
            print(" ".join(cmd), file=sys.stderr)
            subprocess.check_call(cmd)
            ext.extra_objects.append(obj)
        ext.define_macros.append(("HEXISEQ_WITH_CUDA", "1"))
        for libdir in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib")):
            if os.path.isdir(os.path.join(cuda_home, libdir)):
                ext.library_dirs.append(os.path.join(cuda_home, libdir))
        # Static runtime: the extension needs no libcudart at import; without a driver it reports 0 devices.
        ext.libraries += ["cudart_static", "dl", "rt", "pthread", "stdc++"]


core = Extension(
    "hexiseq._core",
    sources=["hexiseq/_core.c"] + sorted(glob.glob("csrc/*.c")),
    include_dirs=["csrc", "kernels", numpy.get_include()],
    extra_compile_args=["-std=c11", "-O3", "-fvisibility=hidden", "-Wall", "-Wno-unknown-pragmas"],
    extra_link_args=[],
    libraries=["m"],
)

setup(version=read_version(), ext_modules=[core], cmdclass={"build_ext": BuildExt})
