"""The on-disk format: a JSON manifest (``manifest.json``) and safetensors data
files. See ``docs/format.md``."""

from .datafile import DTYPES, data_header, dtype_from_name, dtype_name
from .manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest, decode_value, encode_value

__all__ = [
    "DTYPES",
    "dtype_from_name",
    "dtype_name",
    "data_header",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "Manifest",
    "decode_value",
    "encode_value",
]
