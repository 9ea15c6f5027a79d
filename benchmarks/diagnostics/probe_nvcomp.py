"""How nvCOMP's Python ``Codec`` behaves beside CuPy: which threads, streams and devices it needs.

    python -m benchmarks.diagnostics.probe_nvcomp

Each case runs in a fresh subprocess (a CUDA failure must not poison the next case) and decodes one batch
of zstd frames written on the CPU with numcodecs, checking the bytes: the codec with and without
``device_id``/``cuda_stream``, created on the main thread and used on another, and on a thread with and
without a CUDA runtime call first; inputs as whole arrays and as views of one larger device buffer (as the
window buffer is). Prints one line per case, and the cases as JSON to ``--json FILE``. GPU and
``nvidia-nvcomp-cu13`` only.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import traceback

CASES = {
    "main-plain": "the codec with defaults, created and used on the main thread",
    "main-stream": "device_id and a CuPy non-blocking stream, main thread",
    "thread-plain": "created on the main thread, used on a new thread with no CUDA call first",
    "thread-stream": "device_id + stream, created on main, used on a new thread with no CUDA call first",
    "thread-setdevice": "device_id + stream, created on main, used on a thread that called setDevice first",
    "thread-own": "device_id + stream, created and used on the same new thread after setDevice",
    "views": "device_id + stream, inputs as views of one device buffer, main thread",
    "views-thread": "as 'views', created on main, used on a thread after setDevice (gdsload's case)",
    "two-codecs": "a second codec created and dropped before the first decodes (one per dataset)",
}


def case(name: str) -> dict:
    import cupy
    import numcodecs
    import numpy as np
    from nvidia import nvcomp

    rng = np.random.default_rng(0)
    chunks = [rng.zipf(1.3, 65536).astype(np.int32).view(np.uint8) for _ in range(16)]
    frames = [np.frombuffer(numcodecs.Zstd(level=3).encode(c), np.uint8) for c in chunks]
    cupy.cuda.runtime.setDevice(0)
    stream = cupy.cuda.Stream(non_blocking=True)
    kwargs = {} if name.endswith("plain") else {"device_id": 0, "cuda_stream": stream.ptr}

    def make() -> object:
        return nvcomp.Codec(algorithm="Zstd", bitstream_kind=nvcomp.BitstreamKind.RAW, **kwargs)

    def inputs() -> list:
        if not name.startswith("views"):
            return [cupy.asarray(f) for f in frames]
        ends = np.cumsum([len(f) for f in frames])
        buf = cupy.asarray(np.concatenate(frames))
        return [buf[int(e - len(f)):int(e)] for f, e in zip(frames, ends)]

    def decode(codec: object, arrays: list, set_device: bool) -> list:
        if set_device:
            cupy.cuda.runtime.setDevice(0)
        outs = codec.decode(nvcomp.as_arrays(arrays), data_type="|u1")
        got = []
        for i in range(len(arrays)):
            out = cupy.asarray(outs[i])
            stream.synchronize()
            got.append(cupy.asnumpy(out))
        return got

    result: dict = {}

    def run(on_thread: bool, set_device: bool, own: bool) -> None:
        try:
            codec = None if own else make()
            if name == "two-codecs":
                make()
            arrays = inputs()
            cupy.cuda.runtime.deviceSynchronize()

            def body() -> None:
                try:
                    c = codec
                    if own:
                        cupy.cuda.runtime.setDevice(0)
                        c = make()
                    got = decode(c, arrays, set_device)
                    result["exact"] = all(np.array_equal(g, c0) for g, c0 in zip(got, chunks))
                except Exception as e:
                    result["error"] = f"{type(e).__name__}: {e}"
                    result["trace"] = traceback.format_exc(limit=4)

            if on_thread:
                t = threading.Thread(target=body)
                t.start()
                t.join()
            else:
                body()
        except Exception as e:
            result["error"] = f"{type(e).__name__}: {e}"

    run(on_thread="thread" in name, set_device=name in ("thread-setdevice", "views-thread"),
        own=name == "thread-own")
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--case":
        print(json.dumps(case(argv[1])))
        return 0
    from nvidia import nvcomp

    rows = []
    for name, what in CASES.items():
        p = subprocess.run([sys.executable, "-m", "benchmarks.diagnostics.probe_nvcomp", "--case", name],
                           capture_output=True, text=True, timeout=120)
        line = (p.stdout.strip().splitlines() or ["{}"])[-1]
        try:
            res = json.loads(line)
        except json.JSONDecodeError:
            res = {"error": f"exit {p.returncode}: {p.stderr.strip()[-400:]}"}
        res.update(case=name, what=what, returncode=p.returncode)
        rows.append(res)
        print(f"{name:18s} {'exact' if res.get('exact') else 'FAIL ' + str(res.get('error'))}", flush=True)
        if res.get("trace"):
            print(res["trace"], flush=True)
    if "--json" in argv:
        with open(argv[argv.index("--json") + 1], "w") as f:
            json.dump({"nvcomp": nvcomp.__version__, "cases": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
