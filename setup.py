"""Builds recckpt._C, the C++ engine, from csrc/*.cpp.

The engine works on raw buffers (numpy arrays, memoryviews), so the build needs pybind11 and a C++17
compiler but never torch. CUDA sources (csrc/*.cu) are not built yet; the CPU engine is complete on its own.
"""
import glob
import os
import platform
import shutil

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

extra_compile_args = ["-O3", "-fvisibility=hidden"]
if platform.machine() in ("x86_64", "AMD64"):
    # SSE4.2 is compiled per-function (target attribute) and chosen at run time, so no -msse4.2 here.
    pass
if os.environ.get("RECCKPT_DEBUG"):
    extra_compile_args = ["-O0", "-g"]

# The sources compile independently: one compiler per CPU (RECCKPT_BUILD_JOBS overrides) halves a fresh
# build on a 2-core CI machine, which the README's test command pays on every new clone.
ParallelCompile("RECCKPT_BUILD_JOBS", default=0).install()

ext = Pybind11Extension(
    "recckpt._C",
    sorted(glob.glob("csrc/*.cpp")),
    depends=sorted(glob.glob("csrc/*.h")),   # a header's edit rebuilds the engine (else a stale build loads)
    include_dirs=["csrc"],
    cxx_std=17,
    extra_compile_args=extra_compile_args,
    extra_link_args=["-pthread"],
)


class BuildExt(build_ext):
    """pybind11's build_ext, except that RECCKPT_PREBUILT_EXT may name the engine already built from these
    same sources: scripts/setup.sh compiles it in place while pip installs torch, and the editable install
    after that would otherwise compile every source a second time (~70 s on a 2-core machine)."""

    def build_extension(self, ext):
        prebuilt = os.environ.get("RECCKPT_PREBUILT_EXT")
        if not prebuilt:
            return super().build_extension(ext)
        dst = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
        if not (os.path.exists(dst) and os.path.samefile(prebuilt, dst)):
            shutil.copyfile(prebuilt, dst)


setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt})
