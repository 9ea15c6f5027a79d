"""Scratch (not committed): which nvImageCodec call crashes. Each case in its own process."""
import faulthandler, io, subprocess, sys
faulthandler.enable()
import numpy as np

def images(fmt, n=8):
    from PIL import Image
    out = []
    for i in range(n):
        rng = np.random.default_rng(i)
        h, w = 375 - 16 * (i % 3), 500 - 24 * (i % 4)
        base = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(base).resize((w, h), Image.BILINEAR).save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
        out.append(buf.getvalue())
    return out

def case(name, fmt):
    import cupy
    from nvidia import nvimgcodec as nv
    print("nvimgcodec", getattr(nv, "__version__", "?"), flush=True)
    dec = nv.Decoder(device_id=0, options=":fancy_upsampling=1")
    params = nv.DecodeParams(apply_exif_orientation=False, color_spec=getattr(nv.ColorSpec, "SRGB", None) or nv.ColorSpec.RGB)
    blobs = images(fmt)
    host = np.frombuffer(b"".join(blobs), np.uint8)
    offs = np.cumsum([0] + [len(b) for b in blobs])
    views = [host[offs[i]:offs[i + 1]] for i in range(len(blobs))]
    stream = cupy.cuda.Stream(non_blocking=True)
    region = (10, 20, 110, 220)
    keep = []
    def src(v, reg):
        if name == "bytes_whole":
            return nv.CodeStream(bytes(v))
        if name == "owned_whole":
            return nv.CodeStream(v.copy())
        s = nv.CodeStream(v.tobytes() if name.startswith("bytes") else v)
        keep.append(s)
        if reg is None or name in ("view_whole",):
            return s
        sub = s.get_sub_code_stream(region=nv.Region(*reg))
        if name.endswith("dropped"):
            keep.pop()
        return sub
    with stream:
        srcs = [src(v, None if name.endswith("whole") else region) for v in views]
        got = dec.decode(srcs, params=params, cuda_stream=stream.ptr)
        shapes = [None if g is None else tuple(g.shape) for g in got]
        stream.synchronize()
        print(name, fmt, "shapes", shapes, flush=True)
        arr = [cupy.asarray(g).get() for g in got if g is not None]
        print(name, fmt, "ok, mean", [round(float(a.mean()), 1) for a in arr][:3], flush=True)

if __name__ == "__main__":
    if len(sys.argv) > 1:
        case(sys.argv[1], sys.argv[2]); sys.exit(0)
    for fmt in ("JPEG", "PNG"):
        for name in ("owned_whole", "bytes_sub_kept", "bytes_sub_dropped"):
            r = subprocess.run([sys.executable, __file__, name, fmt], capture_output=True, text=True, timeout=120)
            print(f"== {fmt} {name}: rc {r.returncode}\n{r.stdout[-1500:]}\n{r.stderr[-2500:]}", flush=True)
