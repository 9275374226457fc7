"""Build of the hexiseq C extension: the C core in csrc/, the binding, and, when nvcc is found, the CUDA
kernels in kernels/. Set HEXISEQ_CUDA=0 to skip CUDA, HEXISEQ_CUDA_ARCHS="80;90a" to choose targets,
HEXISEQ_NVCC_FLAGS to add nvcc flags."""

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

# The C core's folders (common/ at the bottom; model/ under scheduler/; attention/ beside them, over common/ only):
# each is an include directory, so sources include headers by bare name.
CORE_DIRS = ["csrc/common", "csrc/model", "csrc/scheduler", "csrc/attention"]


def core_files(*patterns):
    """The C core's files matching `patterns` ("*.c", ...), folder by folder in CORE_DIRS order."""
    return [f for d in CORE_DIRS for p in patterns for f in sorted(glob.glob(os.path.join(d, p)))]


def read_version():
    with open(os.path.join(HERE, "csrc", "common", "hexiseq.h")) as f:
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


CUDA_LIB = "libhexiseq_cuda.so"


class BuildExt(build_ext):
    """Builds the extension and, with nvcc, the CUDA kernels library beside it (and reports that library as an
    output, so wheels and editable installs carry it)."""

    cuda_lib = None  # path of the CUDA kernels library in the build tree, when built

    def get_outputs(self):
        outputs = super().get_outputs()
        if self.cuda_lib:
            outputs.append(self.cuda_lib)
        return outputs

    def get_output_mapping(self):  # setuptools' editable installs copy these build -> source paths
        mapping = dict(super().get_output_mapping())
        if self.cuda_lib:
            for src, dst in list(mapping.items()):
                if os.path.basename(src) == os.path.basename(self.get_ext_fullpath("hexiseq._core")):
                    mapping[os.path.join(os.path.dirname(src), CUDA_LIB)] = os.path.join(os.path.dirname(dst), CUDA_LIB)
        return mapping

    def copy_extensions_to_source(self):  # editable installs: put the CUDA library beside the extension
        super().copy_extensions_to_source()
        if self.cuda_lib:
            package_dir = self.get_finalized_command("build_py").get_package_dir("hexiseq")
            self.copy_file(self.cuda_lib, os.path.join(package_dir, CUDA_LIB), level=self.verbose)

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
        # A CPU-only and a CUDA build compile the same sources with different macros: rebuild when the macros
        # differ from the last successful build's, or the other build's extension would be kept as up to date.
        stamp, macros = os.path.join(self.build_temp, "hexiseq-macros"), repr(sorted(ext.define_macros))
        try:
            with open(stamp) as f:
                self.force = self.force or f.read() != macros
        except OSError:
            self.force = True
        super().build_extensions()
        os.makedirs(self.build_temp, exist_ok=True)
        with open(stamp, "w") as f:
            f.write(macros)

    def build_cuda(self, ext, nvcc, sources):
        """Compile kernels/*.cu into libhexiseq_cuda.so beside the extension. The extension opens it only when a
        CUDA tensor arrives (dlopen), so processes that never use CUDA never load the CUDA runtime."""
        archs = os.environ.get("HEXISEQ_CUDA_ARCHS", "80;90").split(";")
        gencode = []
        for a in archs:
            a = a.strip()
            if a:
                gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
        cuda_home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        objdir = os.path.join(self.build_temp, "kernels")
        os.makedirs(objdir, exist_ok=True)
        objects = []
        for src in sources:
            obj = os.path.join(objdir, os.path.basename(src) + ".o")
            cmd = [nvcc, "-c", src, "-o", obj, "-O3", "-std=c++17", "-Xcompiler", "-fPIC,-fvisibility=hidden"]
            cmd += ["-I" + d for d in CORE_DIRS] + ["-Ikernels", "--expt-relaxed-constexpr", "-lineinfo"] + gencode
            cmd += os.environ.get("HEXISEQ_NVCC_FLAGS", "").split()  # extra flags, e.g. -Xptxas=-v
            print(" ".join(cmd), file=sys.stderr)
            subprocess.check_call(cmd)
            objects.append(obj)
        # No csrc/ objects: the library borrows the extension's status helpers and params validation when it is
        # attached (kernels/entry.cu), so the process has one error buffer and one copy of the rules.
        library_dirs = [os.path.join(cuda_home, d) for d in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib"))
                        if os.path.isdir(os.path.join(cuda_home, d))]
        target = os.path.join(os.path.dirname(self.get_ext_fullpath(ext.name)), CUDA_LIB)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        # Static runtime: the library needs no libcudart at load; without a driver it reports 0 devices.
        self.compiler.link_shared_object(objects, target, library_dirs=library_dirs,
                                         libraries=["cudart_static", "dl", "rt", "pthread", "stdc++"],
                                         extra_postargs=["-Wl,-Bsymbolic"])
        self.cuda_lib = target
        ext.define_macros += [("HEXISEQ_WITH_CUDA", "1"), ("HEXISEQ_CUDA_RUNTIME", str(cuda_runtime_version(nvcc)))]
        ext.libraries.append("dl")


def cuda_runtime_version(nvcc):
    """13000 for 'release 13.0' in `nvcc --version`, 0 when it cannot be read."""
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    return int(m.group(1)) * 1000 + int(m.group(2)) * 10 if m else 0


core = Extension(
    "hexiseq._core",
    sources=sorted(glob.glob("hexiseq/binding/*.c")) + core_files("*.c"),
    # headers too, so that editing one rebuilds the extension (setuptools compares their times with the output);
    # *.inc are code included by a .c file of the core (the typed attention tiles), never compiled alone
    depends=["hexiseq/binding/binding.h"] + core_files("*.h", "*.inc") + sorted(glob.glob("kernels/*.h")),
    include_dirs=CORE_DIRS + ["kernels", numpy.get_include()],
    extra_compile_args=["-std=c11", "-O3", "-fvisibility=hidden", "-Wall", "-Wno-unknown-pragmas"],
    extra_link_args=[],
    libraries=["m"],
)

setup(version=read_version(), ext_modules=[core], cmdclass={"build_ext": BuildExt})
