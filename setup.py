"""The one compiled part: the client's per-op hot path (src/gpupool/torch/_fastpath.c).

Everything else is configured in pyproject.toml. The extension is optional: where no C
compiler is, the install still succeeds and the client runs its Python path, which does the
same thing more slowly (`gpupool.torch.fastpath_active()` says which one runs).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "gpupool.torch._fastpath",
            ["src/gpupool/torch/_fastpath.c"],
            optional=True,
            extra_compile_args=["-O2", "-Wall", "-Wno-missing-field-initializers"],
        )
    ]
)
