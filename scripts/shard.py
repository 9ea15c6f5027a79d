#!/usr/bin/env python3
"""A thin wrapper around ``gdsload shard`` (``gdsload.tools.cli.shard_main``), the documented converter.

It takes the same arguments and behaves the same; only its messages start with ``shard.py`` instead of
``gdsload shard``. Convert .npy / .npz / directories of them / zarr arrays into a gdsload dataset:

    python scripts/shard.py images.npy labels.npy -o mydata.gds
    python scripts/shard.py data.npz --block-bytes 4MiB --shard-bytes 1GiB -o mydata.gds
    python scripts/shard.py --field image=raw/imgs.npz:x --field label=raw/labels.npy -o mydata.gds

The dataset is written to a temporary sibling directory and renamed into place in one atomic step, so the
output is either complete or absent. Files of a directory input are taken in natural order (2.npy before
10.npy); the summary names the first and last. --overwrite replaces only an existing gdsload dataset, never
a file, a directory holding an input, or the working directory.

Exit codes: 0 done; 2 with a one-line message naming the file for any failure (bad input, full disk, ...),
nothing left at the output path; 130 / 143 / 129 when stopped by SIGINT / SIGTERM / SIGHUP, cleaned up the
same way. A temporary directory left by a converter killed with SIGKILL is removed by the next conversion
to the same output.
"""

import sys

from gdsload.tools.cli import shard_main

if __name__ == "__main__":
    sys.exit(shard_main())
