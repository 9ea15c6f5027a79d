"""gdsload: sharded Zarr v3 datasets from NVMe into GPU memory, through KvikIO, a pinned staging pool or
a RAM tier."""

from .dataset import GDSDataset
from .mixture.mixture import Mixture
from .errors import (BackendUnavailable, ChecksumError, ConversionError, DecodeError, FormatError, GDSLoadError,
                     ReadError)
from .conversion.source_types import ArraySource, RaggedSource, Source
from .pipeline.resume import merge_states  # a GDSDataset's states and a Mixture's
from .pipeline.stats import EpochStats
from .conversion.writer import convert, write_dataset
from .conversion.images import convert_images
from .codecs.image_params import ImageSpec

__version__ = "0.1.0"

__all__ = [
    "GDSDataset", "EpochStats", "GDSLoadError", "FormatError", "ConversionError", "ReadError", "ChecksumError",
    "DecodeError", "BackendUnavailable", "Mixture", "merge_states",
    "convert", "write_dataset", "convert_images", "ImageSpec", "Source", "ArraySource", "RaggedSource", "__version__",
]
