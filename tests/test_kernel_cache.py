"""Compiled kernels kept on disk (gdsload.cuda.kernels): on the CPU with a stand-in for CuPy that records
what it was asked to compile and load; on the GPU, a fresh process that loads the gathers without NVRTC."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from gdsload.cuda.kernels import cache_dir, cache_key, load_module


class FakeCupy:
    """CuPy as load_module uses it: a compiler whose output is the source's bytes, and RawModule that loads
    a file only if it holds what the compiler made."""

    __version__ = "14.2.0"

    def __init__(self, cc: str = "90"):
        self.compiled: list[str] = []
        self.loaded: list[str] = []
        self.from_code: list[str] = []
        fake = self

        def compile_using_nvrtc(source, cache_in_memory=False):
            assert cache_in_memory
            fake.compiled.append(source)
            return b"BIN:" + source.encode(), {}

        class RawModule:
            def __init__(self, *, path=None, code=None):
                self.path, self.code = path, code

            def get_function(self, name):
                if self.code is not None:
                    fake.from_code.append(self.code)
                    return ("kernel", name)
                with open(self.path, "rb") as f:
                    if not f.read().startswith(b"BIN:"):
                        raise RuntimeError("CUDA_ERROR_INVALID_IMAGE")
                fake.loaded.append(self.path)
                return ("kernel", name)

        self.RawModule = RawModule
        runtime = SimpleNamespace(runtimeGetVersion=lambda: 13000, driverGetVersion=lambda: 13010)
        self.cuda = SimpleNamespace(runtime=runtime, compiler=SimpleNamespace(compile_using_nvrtc=compile_using_nvrtc),
                                    Device=lambda i: SimpleNamespace(compute_capability=cc))


def test_the_first_process_compiles_and_keeps_the_binary_every_later_one_only_loads_it(tmp_path):
    first = FakeCupy()
    load_module(first, "src", 0, probe="k", folder=str(tmp_path))
    assert first.compiled == ["src"] and len(first.loaded) == 1
    (path,) = [p for p in os.listdir(tmp_path) if not p.startswith(".")]
    assert (tmp_path / path).read_bytes() == b"BIN:src"
    later = FakeCupy()
    module = load_module(later, "src", 0, probe="k", folder=str(tmp_path))
    assert later.compiled == [] and later.loaded == [str(tmp_path / path)]
    assert module.get_function("k") == ("kernel", "k")


def test_another_source_or_device_or_version_gets_its_own_file(tmp_path):
    for cupy, source in [(FakeCupy(), "a"), (FakeCupy(), "b"), (FakeCupy(cc="80"), "a")]:
        load_module(cupy, source, 0, probe="k", folder=str(tmp_path))
        assert cupy.compiled == [source]
    assert len(os.listdir(tmp_path)) == 3
    facts = ("14.2.0", 13000, 13010, "90")
    keys = {cache_key("a", facts), cache_key("b", facts), cache_key("a", ("14.2.1", *facts[1:])),
            cache_key("a", (*facts[:2], 13020, facts[3])), cache_key("a", (*facts[:3], "100"))}
    assert len(keys) == 5 and cache_key("a", facts) == cache_key("a", facts)


def test_a_file_the_driver_refuses_is_compiled_again_and_replaced(tmp_path):
    load_module(FakeCupy(), "src", 0, probe="k", folder=str(tmp_path))
    (path,) = os.listdir(tmp_path)
    (tmp_path / path).write_bytes(b"\x7fELF truncated")
    again = FakeCupy()
    load_module(again, "src", 0, probe="k", folder=str(tmp_path))
    assert again.compiled == ["src"] and (tmp_path / path).read_bytes() == b"BIN:src"
    assert os.listdir(tmp_path) == [path]  # no temporary file left beside it


def test_a_folder_that_cannot_be_written_falls_back_to_cupys_own_cache(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    cupy = FakeCupy()
    module = load_module(cupy, "src", 0, probe="k", folder=str(blocker / "kernels"))
    assert module.code == "src" and cupy.from_code == ["src"]


def test_a_failed_write_leaves_no_temporary_file(tmp_path):
    """A write the file system refuses (here: past the process's file-size limit, EFBIG): CuPy's own module,
    and nothing left in the folder. In a process of its own, whose limit is what fails the write."""
    script = textwrap.dedent(f"""
        import os, resource, signal
        from test_kernel_cache import FakeCupy
        from gdsload.cuda.kernels import load_module
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (4, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        cupy = FakeCupy()
        load_module(cupy, "src", 0, probe="k", folder={str(tmp_path)!r})
        print(cupy.from_code, os.listdir({str(tmp_path)!r}))
    """)
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[0] == "['src'] []", done.stdout


def test_the_cache_folder_follows_the_environment(tmp_path):
    assert cache_dir({"GDSLOAD_CACHE_DIR": "/x/y"}) == os.path.join("/x/y", "kernels")
    assert cache_dir({"XDG_CACHE_HOME": "/c"}) == os.path.join("/c", "gdsload", "kernels")
    assert cache_dir({}).endswith(os.path.join(".cache", "gdsload", "kernels"))


@pytest.mark.gpu
def test_a_fresh_process_gathers_from_the_kept_binary_without_nvrtc(tmp_path):
    """The defect: every process ran NVRTC (CuPy's cache key) before its first gather."""
    code = textwrap.dedent("""
        import json, cupy, numpy as np
        from cupy.cuda import compiler
        from gdsload.cuda.ops import CudaOps
        ops = CudaOps(0, "cupy")
        src = cupy.asarray(np.arange(300 * 12, dtype=np.uint8).reshape(300, 12))  # no CuPy kernel compiled
        idx = cupy.asarray(np.arange(299, -1, -3, dtype=np.int64))
        out = cupy.empty((100, 12), dtype=cupy.uint8)
        cupy.cuda.Device().synchronize()  # the uploads ran on the null stream, the gather's does not wait for it
        with ops.scope():
            assert ops.gather(src, idx, out)
        ops.work.synchronize()
        assert (cupy.asnumpy(out) == cupy.asnumpy(src)[cupy.asnumpy(idx)]).all()
        print(json.dumps(len(compiler._empty_file_preprocess_cache)))
    """)
    env = {**os.environ, "GDSLOAD_CACHE_DIR": str(tmp_path)}

    def run() -> int:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        return int(out.stdout.strip().splitlines()[-1])

    run()  # compiles (NVRTC) and keeps the binary
    assert len(os.listdir(tmp_path / "kernels")) == 1
    assert run() == 0  # loaded from the file: NVRTC never ran in this process
