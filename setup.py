"""mita_seg: MiTA for MMSegmentation. Builds the optional CPU kernel ``mita_seg._C``
(needs torch at build time: install with ``--no-build-isolation``; scripts/setup_env.sh
does). Set MITA_NO_EXT=1 to skip it (the plain PyTorch backend is used then).
MITA_SANITIZE=1 builds it with AddressSanitizer and UndefinedBehaviorSanitizer instead (for
`make test-sanitize`, which builds it into build/sanitize, never in place)."""
import os

from setuptools import setup

ext_modules, cmdclass = [], {}
if not os.environ.get('MITA_NO_EXT'):
    from torch.utils.cpp_extension import BuildExtension, CppExtension
    sanitize = ['-fsanitize=address,undefined', '-fno-sanitize-recover=all',
                '-fno-omit-frame-pointer'] if os.environ.get('MITA_SANITIZE') else []
    ext_modules.append(
        # Built for the baseline ISA, with IEEE maths (no -march=native, no -ffast-math):
        # the kernel picks its AVX2 code at run time; MKL dispatches its own GEMMs.
        # -fopenmp: at::parallel_for is inline OpenMP in ATen's headers (without it the
        # kernel runs on one thread); libgomp.so.1 resolves to the copy torch has loaded.
        CppExtension('mita_seg._C', ['mita_seg/ops/csrc/mita_cpu.cpp'],
                     extra_compile_args=['-O1' if sanitize else '-O3', '-fopenmp'] + sanitize,
                     extra_link_args=['-fopenmp'] + sanitize))
    cmdclass['build_ext'] = BuildExtension

# Name, version, dependencies and packages are in pyproject.toml.
setup(ext_modules=ext_modules, cmdclass=cmdclass)
