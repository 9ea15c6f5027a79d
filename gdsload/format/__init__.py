"""The on-disk format, read without any I/O beyond the dataset's own files: Zarr v3 metadata, shard indexes,
arrays, foreign stores and the block layout of an open dataset. Imports nothing else of gdsload but errors."""
