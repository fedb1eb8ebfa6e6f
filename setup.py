"""The two compiled parts: the client's per-op hot path (src/gpupool/torch/_fastpath.c) and
the worker's record loop (src/gpupool/worker/_runloop.c).

Everything else is configured in pyproject.toml. Both extensions are optional: where no C
compiler is, the install still succeeds and client and worker run their Python paths, which do
the same thing more slowly (`gpupool.torch.fastpath_active()` and
`gpupool.worker.executor.compiled_loop()` say which one runs).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "gpupool.torch._fastpath",
            ["src/gpupool/torch/_fastpath.c"],
            optional=True,
            extra_compile_args=["-O2", "-Wall", "-Wno-missing-field-initializers"],
        ),
        Extension(
            "gpupool.worker._runloop",
            ["src/gpupool/worker/_runloop.c"],
            optional=True,
            extra_compile_args=["-O2", "-Wall", "-Wno-missing-field-initializers"],
        ),
    ]
)
