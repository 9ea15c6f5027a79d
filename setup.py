"""Builds the native stager (gdsload/backends/native/_stage.c) when a C compiler is there; every other setting
is in pyproject.toml. The library is loaded with ctypes, not imported (it has no PyInit), and optional=True
lets the install go on without it: gdsload then compiles it at first use, or runs its pure-Python path."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("gdsload.backends.native._stage", sources=["gdsload/backends/native/_stage.c"],
                             optional=True, extra_compile_args=["-O2", "-std=c11", "-pthread"],
                             extra_link_args=["-pthread"], libraries=["dl", "pthread"])])
