"""mita_seg: MiTA for MMSegmentation. Builds the optional CPU kernel ``mita_seg._C``
(needs torch at build time: install with ``--no-build-isolation``; scripts/setup_env.sh
does). Set MITA_NO_EXT=1 to skip it (the plain PyTorch backend is used then)."""
import os

from setuptools import find_packages, setup

ext_modules, cmdclass = [], {}
if not os.environ.get('MITA_NO_EXT'):
    from torch.utils.cpp_extension import BuildExtension, CppExtension
    ext_modules.append(
        # Built for the baseline ISA, with IEEE maths (no -march=native, no -ffast-math):
        # the kernel picks its AVX2 exponential at run time; MKL dispatches its own GEMMs.
        CppExtension('mita_seg._C', ['mita_seg/ops/csrc/mita_cpu.cpp'],
                     extra_compile_args=['-O3', '-fopenmp-simd']))
    cmdclass['build_ext'] = BuildExtension

setup(
    name='mita_seg',
    version='0.1.0',
    description='MiTA (Mixture-of-Top-k Attention) for MMSegmentation 1.x',
    packages=find_packages(include=['mita_seg', 'mita_seg.*']),
    python_requires='>=3.9',
    install_requires=[
        'torch>=2.1',
        'mmcv==2.1.0',
        'mmengine==0.10.7',
        'mmsegmentation==1.2.2',
    ],
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
