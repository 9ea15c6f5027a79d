"""The chunk codecs gdsload decodes, as zarr names them: which a store may use (checked when its metadata is
read, so an array that cannot be decoded fails at open, naming the codec) and the numcodecs codec that undoes
each one. Pure: nothing here reads a chunk."""

from __future__ import annotations

from typing import Any

from .zarr_json import exc_text, fail, show


def check_codec(where: str, name: Any, cfg: dict[str, Any]) -> None:
    """Refuse, naming the codec and the array (``where``: its ``zarr.json``), a chunk codec after ``bytes``
    that gdsload cannot decode: unknown to zarr's codec registry, not bytes-to-bytes (``transpose`` and other
    array-to-array codecs), or a configuration zarr or numcodecs refuses."""
    if name == "crc32c":
        return
    import zarr.registry
    from zarr.abc.codec import BytesBytesCodec

    try:
        cls = zarr.registry.get_codec_class(str(name))
    except Exception:
        raise fail(where, f"unknown codec {show(name)} (not in zarr's codec registry); gdsload cannot decode "
                          f"its chunks: convert the store with 'gdsload shard'") from None
    if not (isinstance(cls, type) and issubclass(cls, BytesBytesCodec)):
        raise fail(where, f"codec {show(name)} after 'bytes' is not a bytes-to-bytes codec (a filter that "
                          f"changes the array), which gdsload does not read; convert the store with "
                          f"'gdsload shard'")
    try:
        host_codec(str(name), cfg)
    except Exception as e:
        raise fail(where, f"codec {show(name)} with configuration {show(cfg)} cannot be decoded ({exc_text(e)})"
                   ) from None


def host_codec(name: str, cfg: dict[str, Any]) -> Any:
    """The numcodecs codec zarr's own codec class of that name decodes with (``decode(buf)`` -> bytes)."""
    import numcodecs

    if name == "zstd":
        from zarr.codecs import ZstdCodec

        z = ZstdCodec.from_dict({"name": name, "configuration": cfg})
        return numcodecs.Zstd(level=z.level)
    if name == "gzip":
        from zarr.codecs import GzipCodec

        return numcodecs.GZip(level=GzipCodec.from_dict({"name": name, "configuration": cfg}).level)
    if name == "blosc":
        from zarr.codecs import BloscCodec

        BloscCodec.from_dict({"name": name, "configuration": cfg})  # zarr's check of the configuration
        return numcodecs.Blosc()  # blosc frames carry what decoding needs
    if name.startswith("numcodecs."):
        return numcodecs.get_codec({**cfg, "id": name[len("numcodecs."):]})
    raise ValueError(f"no decoder for codec {name!r}")
