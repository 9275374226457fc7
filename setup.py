"""Build of the hexiseq C extension: the C core in csrc/, the binding, and the CUDA kernels in kernels/ where they
can run. The CUDA kernels are built when nvcc is found and an NVIDIA GPU is visible at build time (for that GPU's
architecture only), or when asked: HEXISEQ_CUDA=1 builds them (for HEXISEQ_CUDA_ARCHS, else the visible GPUs' or
"80;90"), HEXISEQ_CUDA=0 never. HEXISEQ_CUDA_ARCHS="80;90" chooses targets, HEXISEQ_NVCC_FLAGS adds nvcc flags,
HEXISEQ_BUILD_JOBS caps how many nvcc run at once (default: one per core)."""

import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))

# The C core's folders (common/ at the bottom; model/ under scheduler/; assign/ and attention/ beside them, over
# common/ only): each is an include directory, so sources include headers by bare name.
CORE_DIRS = ["csrc/common", "csrc/model", "csrc/scheduler", "csrc/assign", "csrc/pipeline", "csrc/attention"]


def core_files(*patterns):
    """The C core's files matching `patterns` ("*.c", ...), folder by folder in CORE_DIRS order."""
    return [f for d in CORE_DIRS for p in patterns for f in sorted(glob.glob(os.path.join(d, p)))]


def read_version():
    with open(os.path.join(HERE, "csrc", "common", "hexiseq.h")) as f:
        return re.search(r'#define HEXISEQ_VERSION "([^"]+)"', f.read()).group(1)


def find_nvcc():
    for cand in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if cand and os.path.isfile(os.path.join(cand, "bin", "nvcc")):
            return os.path.join(cand, "bin", "nvcc")
    return shutil.which("nvcc")


def visible_gpu_archs():
    """The architectures ("90", "80", ...) of the NVIDIA GPUs visible now, from nvidia-smi; [] when none is. A GPU
    listed without a readable compute capability (an old driver) counts as visible with no known architecture."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return []
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=60)
        if out.returncode != 0:
            listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
            return [""] if listed.returncode == 0 and "GPU " in listed.stdout else []
    except (OSError, subprocess.SubprocessError):
        return []
    caps = [line.strip() for line in out.stdout.splitlines() if re.fullmatch(r"\d+\.\d+", line.strip())]
    return sorted({c.replace(".", "") for c in caps})


def cuda_decision():
    """(archs, why): the architectures to build the CUDA kernels for, or None and why they are not built."""
    wanted = os.environ.get("HEXISEQ_CUDA", "").strip()
    if wanted not in ("", "0", "1"):
        raise SystemExit(f"hexiseq: HEXISEQ_CUDA must be 0 or 1 (unset: build when a GPU is visible), got {wanted!r}")
    if wanted == "0":
        return None, "HEXISEQ_CUDA=0"
    nvcc = find_nvcc()
    listed = [a.strip() for a in os.environ.get("HEXISEQ_CUDA_ARCHS", "").split(";") if a.strip()]
    for a in listed:
        if not re.fullmatch(r"\d+[af]?", a):
            raise SystemExit(f"hexiseq: HEXISEQ_CUDA_ARCHS entries are compute capabilities like 80 or 90a, got {a!r}")
    if wanted == "1" or listed:  # asked for by name, or by naming the targets
        if not nvcc:
            raise SystemExit(f"hexiseq: {'HEXISEQ_CUDA=1' if wanted == '1' else 'HEXISEQ_CUDA_ARCHS'} asks for the "
                             "CUDA kernels but nvcc was not found (looked in CUDA_HOME, CUDA_PATH, "
                             "/usr/local/cuda and PATH)")
        visible = [a for a in visible_gpu_archs() if a]
        return (listed or visible or ["80", "90"]), None
    if not nvcc:
        return None, "nvcc not found at build time"
    visible = visible_gpu_archs()
    if not visible:
        return None, "no NVIDIA GPU visible at build time"
    return (listed or [a for a in visible if a] or ["80", "90"]), None


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
        archs, why = cuda_decision()
        cu_sources = sorted(glob.glob(os.path.join("kernels", "*.cu")))
        if archs and cu_sources:
            self.build_cuda(ext, find_nvcc(), cu_sources, archs)
        else:
            # build_info() carries the reason, so `hexiseq info` and the first CUDA call can say it
            ext.define_macros.append(("HEXISEQ_CUDA_SKIPPED", '"%s"' % why))
            print(f"hexiseq: building without the CUDA kernels ({why}); HEXISEQ_CUDA=1 builds them", file=sys.stderr)
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

    def build_cuda(self, ext, nvcc, sources, archs):
        """Compile kernels/*.cu into libhexiseq_cuda.so beside the extension, the files side by side (one nvcc per
        core). The extension opens it only when a CUDA tensor arrives (dlopen), so processes that never use CUDA
        never load the CUDA runtime."""
        gencode = []
        for a in archs:
            gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
        cuda_home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        objdir = os.path.join(self.build_temp, "kernels")
        os.makedirs(objdir, exist_ok=True)
        jobs = os.environ.get("HEXISEQ_BUILD_JOBS", "").strip()
        if jobs and not jobs.isdigit():
            raise SystemExit(f"hexiseq: HEXISEQ_BUILD_JOBS must be a whole number of nvcc processes, got {jobs!r}")
        jobs = int(jobs or 0) or (os.cpu_count() or 1)
        print(f"hexiseq: compiling {len(sources)} CUDA files for sm_{', sm_'.join(archs)}, {jobs} at a time "
              "(minutes; HEXISEQ_CUDA=0 skips them)", file=sys.stderr)
        start = time.monotonic()

        def compile_one(src):
            obj = os.path.join(objdir, os.path.basename(src) + ".o")
            cmd = [nvcc, "-c", src, "-o", obj, "-O3", "-std=c++17", "-Xcompiler", "-fPIC,-fvisibility=hidden"]
            cmd += ["-I" + d for d in CORE_DIRS] + ["-Ikernels", "--expt-relaxed-constexpr", "-lineinfo"] + gencode
            cmd += os.environ.get("HEXISEQ_NVCC_FLAGS", "").split()  # extra flags, e.g. -Xptxas=-v
            subprocess.check_call(cmd)
            print(f"hexiseq: {src} compiled ({time.monotonic() - start:.0f} s)", file=sys.stderr)
            return obj

        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            # the slowest files first, so that the last to start is not the longest
            order = sorted(sources, key=os.path.getsize, reverse=True)
            objects = dict(zip(order, pool.map(compile_one, order)))
        objects = [objects[src] for src in sources]
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
        ext.define_macros += [("HEXISEQ_WITH_CUDA", "1"), ("HEXISEQ_CUDA_RUNTIME", str(cuda_runtime_version(nvcc))),
                              ("HEXISEQ_CUDA_ARCHS", '"%s"' % ";".join(archs))]
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
