"""The on-disk format: a JSON manifest (``manifest.json``) and safetensors data
files. See ``docs/format.md``."""

from .datafile import DTYPES, dtype_from_name, dtype_name, write_data_file
from .manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest, decode_value, encode_value

__all__ = [
    "DTYPES",
    "dtype_from_name",
    "dtype_name",
    "write_data_file",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "Manifest",
    "decode_value",
    "encode_value",
]
