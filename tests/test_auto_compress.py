"""``gdsload shard --compress auto``: a fixed field is stored zstd-compressed only where zstd saves at least
10 % over a fixed sample of its chunks; the rest are stored raw, and the codecs in the metadata say which."""

from __future__ import annotations

import re

import numpy as np
import pytest
import zarr

from gdsload import GDSDataset, write_dataset
from gdsload.conversion.auto_compress import MIN_SAVING, sample_chunks, zstd_saving
from gdsload.conversion.plan import plan_dataset
from gdsload.conversion.source_types import ArraySource
from gdsload.format.meta import read_metadata

from test_compression import cli

rng = np.random.default_rng(3)
N = 600
NOISE = rng.integers(0, 256, (N, 32, 32), dtype=np.uint8)  # random pixels: zstd saves nothing
TOKENS = rng.zipf(1.3, (N, 256)).clip(0, 50_000).astype(np.int32)  # Zipf token ids: zstd saves most


def test_the_sample_is_spread_over_the_field_and_always_the_same():
    assert sample_chunks(5).tolist() == [0, 1, 2, 3, 4]
    picked = sample_chunks(1000)
    assert picked[0] == 0 and picked[-1] == 999 and len(picked) == 8
    assert np.all(np.diff(picked) > 100) and picked.tolist() == sample_chunks(1000).tolist()


def test_random_bytes_save_too_little_and_zipf_tokens_enough():
    noise = zstd_saving(ArraySource("n", NOISE), NOISE.dtype, N, 16, 3)
    tokens = zstd_saving(ArraySource("t", TOKENS), TOKENS.dtype, N, 16, 3)
    assert noise < MIN_SAVING <= 0.10 < tokens, (noise, tokens)


def test_the_decision_reads_only_the_sampled_chunks_and_is_the_same_in_every_plan(tmp_path):
    """What a conversion in parts needs: each process plans alike (the plan's description, per-array levels
    included, is equal), from the sampled chunks' rows only."""
    class Counting(ArraySource):
        reads: list[tuple[int, int]] = []

        def read(self, start, stop):
            Counting.reads.append((start, stop))
            return super().read(start, stop)

    sources = {"noise": Counting("noise", NOISE), "tokens": ArraySource("tokens", TOKENS)}
    plans = [plan_dataset(str(tmp_path / "o.gds"), sources, {}, compress="auto", chunk_bytes=4 << 10)
             for _ in range(2)]
    assert plans[0].describe() == plans[1].describe()
    assert {a.key: a.level for a in plans[0].arrays} == {"noise": None, "tokens": 3}
    per_chunk = plans[0].array("noise").per_chunk
    chunks = sample_chunks(-(-N // per_chunk)).tolist()
    assert sorted(set(Counting.reads)) == [(c * per_chunk, min((c + 1) * per_chunk, N)) for c in chunks]


def test_shard_compress_auto_stores_noise_raw_and_tokens_compressed(tmp_path):
    """The command line: random uint8 images stay raw, Zipf tokens (and the labels, an arange) get zstd at the
    level asked with their crc32c; zarr and gdsload read every field back exactly; ``info`` shows the codecs."""
    for name, data in (("images", NOISE), ("tokens", TOKENS), ("label", np.arange(N))):
        np.save(tmp_path / f"{name}.npy", data)
    out = str(tmp_path / "a.gds")
    done = cli("shard", *(str(tmp_path / f"{n}.npy") for n in ("images", "tokens", "label")), "-o", out,
               "--compress", "auto:5", "--chunk-bytes", "16KiB", "--quiet")
    assert done.returncode == 0, done.stderr
    g = zarr.open_group(out, mode="r")
    assert list(g["images"].compressors) == []
    for name in ("tokens", "label"):
        assert [c.to_dict()["name"] for c in g[name].compressors] == ["zstd", "crc32c"]
        assert g[name].compressors[0].level == 5
    meta = read_metadata(out)
    assert not meta.fields["images"].compressed and meta.fields["tokens"].compressed
    np.testing.assert_array_equal(g["images"][:], NOISE)
    with GDSDataset(out, batch_size=64, backend="cpu", shuffle=True, verify=True, resident_bytes=0) as ds:
        for b in ds:
            np.testing.assert_array_equal(b["images"], NOISE[b["label"]])
            np.testing.assert_array_equal(b["tokens"], TOKENS[b["label"]])
    info = cli("info", out)
    assert re.search(r"images: .*codecs \['bytes'\]", info.stdout), info.stdout
    assert re.search(r"tokens: .*codecs \['bytes', 'zstd', 'crc32c'\], ratio 0\.\d+", info.stdout), info.stdout


@pytest.mark.parametrize("text", ["auto:x", "auto:23", "automatic"])
def test_bad_auto_options_are_refused(tmp_path, text):
    from gdsload.errors import ConversionError

    with pytest.raises(ConversionError, match=r"--compress takes zstd, zstd:LEVEL, auto or auto:LEVEL|at most 22"):
        write_dataset(str(tmp_path / "o.gds"), {"x": ArraySource("x", TOKENS)}, compress=text, progress=False)
