#!/usr/bin/env python3
"""Convert .npy / .npz / directories of them / zarr arrays into a gdsload dataset.

    python scripts/shard.py images.npy labels.npy -o mydata.gds
    python scripts/shard.py data.npz --block-bytes 4MiB --shard-bytes 1GiB -o mydata.gds
    python scripts/shard.py --field image=raw/imgs.npz:x --field label=raw/labels.npy -o mydata.gds

Exit code 2 with a one-line message naming the input for bad input; nothing is left at the output path.
"""

import sys

from gdsload.cli import shard_main

if __name__ == "__main__":
    sys.exit(shard_main())
