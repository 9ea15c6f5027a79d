"""gdsload's S3Client ranged reads with obstore against botocore, through the client's own call bound (a thread
per call): 8 threads of 4 MiB ranges of one 256 MiB object from benchmarks/sendfile_server.py, alternating.

    python -m benchmarks.sendfile_server ROOT &   # ROOT/bkt/obj.bin; prints the port
    python benchmarks/s3_client_ab.py botocore|obstore PORT

The obstore mode needed S3Client.read through obstore.get (a diagnostic branch, not kept)."""
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

mode, port = sys.argv[1], sys.argv[2]
os.environ["GDSLOAD_S3_READS"] = mode
for k, v in (("AWS_ACCESS_KEY_ID", "x"), ("AWS_SECRET_ACCESS_KEY", "x"), ("AWS_DEFAULT_REGION", "us-east-1")):
    os.environ.setdefault(k, v)
from gdsload.remote.s3 import S3Client  # noqa: E402

c = S3Client(endpoint_url=f"http://127.0.0.1:{port}")
info = c.head("s3://bkt/obj.bin")
R = 4 << 20
c.read(info, 0, R)
t0, cpu0 = time.perf_counter(), time.process_time()
with ThreadPoolExecutor(8) as p:
    n = sum(len(b) for b in p.map(lambda o: c.read(info, o, R), range(0, info.size, R)))
t = time.perf_counter() - t0
print(mode, round(n / t / 1e9, 3), "GB/s", round((time.process_time() - cpu0) / (n / 1e9), 3), "CPU s/GB")
