"""gdsload: sharded datasets from NVMe into GPU memory, through KvikIO or a pinned staging pool."""

from .dataset import GDSDataset
from .errors import BackendUnavailable, ConversionError, FormatError, GDSLoadError, ReadError
from .format import DatasetLayout, DatasetMeta, FieldMeta, read_metadata
from .writer import convert, write_dataset

__version__ = "0.1.0"

__all__ = [
    "GDSDataset", "GDSLoadError", "FormatError", "ConversionError", "ReadError", "BackendUnavailable",
    "DatasetLayout", "DatasetMeta", "FieldMeta", "read_metadata", "convert", "write_dataset", "__version__",
]
