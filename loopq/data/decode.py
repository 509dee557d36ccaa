"""Bytes of a text source -> text, decided by content (magic bytes), never by the file name alone.

Calibration and pretraining read whatever file a user lists; a compressed or binary file decoded as text would be
tokenized into garbage and calibrated on without a word. :func:`decode_text` applies these rules in order:

1. **Compressed streams are decompressed knowingly**: gzip (``1f 8b``), bzip2 (``BZh1``-``BZh9`` followed by a block
   or end-of-stream magic) and xz (``fd 37 7a 58 5a 00``), whatever the suffix (``.gz``/``.bz2``/``.xz`` or none;
   a ``.gz`` name over plain text is read as plain text). One layer only: the decompressed bytes go through rules
   2-5, so a ``.tar.gz`` is refused as a tar archive and a doubly compressed file as compressed data. A corrupt or
   truncated stream is refused.
2. **Known binary formats are refused by name**: zip (also ``.docx``, ``.npz``, torch ``.pt``), zstd, lz4, 7z, tar,
   safetensors, pickle, numpy ``.npy``, PDF, HDF5, Parquet, Arrow, GGUF, ELF, PNG, JPEG, GIF.
3. A UTF-16/UTF-32 byte-order mark is refused (convert to UTF-8); a UTF-8 byte-order mark is dropped.
4. **Binary content**: any NUL byte, or more than ``MAX_CONTROL`` (1 %) of bytes that are control characters other
   than tab, newline, vertical tab, form feed, carriage return and escape, is refused.
5. **UTF-8**: at most ``MAX_INVALID_UTF8`` (one invalid sequence per 1,000 bytes) is tolerated and replaced by
   U+FFFD (a stray Latin-1 byte in a large corpus); more is refused as "not UTF-8" (a Latin-1/cp1252 file) with the
   ``iconv`` command that converts it.

Every refusal is one :class:`DataError` line that starts with the file's label and says what to do.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import zlib
from collections.abc import Callable
from pathlib import Path

from loopq.errors import DataError

#: tolerated fraction of invalid UTF-8 sequences (replaced by U+FFFD) before a file is refused as not UTF-8
MAX_INVALID_UTF8 = 1e-3
#: tolerated fraction of control bytes (other than whitespace and escape) before a file is refused as binary
MAX_CONTROL = 0.01
#: suffixes a compressed source may carry; ``docs.jsonl.gz`` is read as ``.jsonl``
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz")

_DECOMPRESSORS: dict[str, Callable[[bytes], bytes]] = {
    "gzip": gzip.decompress,
    "bzip2": bz2.decompress,
    "xz": lzma.decompress,
}
_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"PK\x03\x04", "a zip archive (.zip/.docx/.npz/torch .pt)"),
    (b"PK\x05\x06", "an empty zip archive"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed data (decompress it first: zstd -d)"),
    (b"\x04\x22\x4d\x18", "lz4-compressed data (decompress it first: lz4 -d)"),
    (b"7z\xbc\xaf\x27\x1c", "a 7z archive"),
    (b"\x93NUMPY", "a numpy .npy array"),
    (b"%PDF-", "a PDF document (extract its text first, e.g. pdftotext)"),
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file"),
    (b"PAR1", "a Parquet file (export its text column to .jsonl)"),
    (b"ARROW1", "an Arrow file (export its text column to .jsonl)"),
    (b"GGUF", "a GGUF model file"),
    (b"\x7fELF", "an executable (ELF)"),
    (b"\x89PNG", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"GIF8", "a GIF image"),
)
_BOMS: tuple[tuple[bytes, str], ...] = (  # UTF-32 first: its little-endian BOM starts with UTF-16's
    (b"\xff\xfe\x00\x00", "UTF-32"),
    (b"\x00\x00\xfe\xff", "UTF-32"),
    (b"\xff\xfe", "UTF-16"),
    (b"\xfe\xff", "UTF-16"),
)
_UTF8_BOM = b"\xef\xbb\xbf"
_CONTROL = bytes(b for b in range(32) if b not in (9, 10, 11, 12, 13, 27))


def compression(data: bytes) -> str | None:
    """``"gzip"``, ``"bzip2"``, ``"xz"`` when ``data`` starts with that format's magic bytes, else ``None``."""
    if data[:2] == b"\x1f\x8b":
        return "gzip"
    if data[:3] == b"BZh" and data[3:4].isdigit() and data[4:10] in (b"1AY&SY", b"\x17\x72\x45\x38\x50\x90"):
        return "bzip2"
    if data[:6] == b"\xfd7zXZ\x00":
        return "xz"
    return None


def binary_format(data: bytes) -> str | None:
    """The name of a known binary format ``data`` starts with (rule 2), else ``None``."""
    for magic, what in _MAGIC:
        if data.startswith(magic):
            return what
    if compression(data):
        return f"{compression(data)} data compressed twice (decompress the outer layer first)"
    if len(data) > 262 and data[257:262] == b"ustar":
        return "a tar archive (extract it and list the text files)"
    if len(data) >= 10 and data[8:9] == b"{" and int.from_bytes(data[:8], "little") <= len(data) - 8:
        return "a safetensors file"
    if len(data) >= 2 and data[0] == 0x80 and 2 <= data[1] <= 5:
        return "a Python pickle"
    return None


def decompress(data: bytes, label: str) -> bytes:
    """Rule 1: one layer of gzip/bzip2/xz removed (``data`` unchanged when it is not compressed)."""
    kind = compression(data)
    if kind is None:
        return data
    try:
        return _DECOMPRESSORS[kind](data)
    except (OSError, EOFError, ValueError, lzma.LZMAError, zlib.error) as err:
        raise DataError(f"{label}: corrupt or truncated {kind} data ({err}); re-create the file") from err


def decode_text(data: bytes, label: str) -> str:
    """Text of a source file's bytes, following rules 1-5 of the module docstring."""
    data = decompress(data, label)
    what = binary_format(data)
    if what is not None:
        raise DataError(f"{label}: {what}, not text; list UTF-8 text or .jsonl files (.gz/.bz2/.xz are fine)")
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            raise DataError(f"{label}: {encoding} text; convert it to UTF-8 (iconv -f {encoding} -t UTF-8)")
    data = data.removeprefix(_UTF8_BOM)
    if b"\x00" in data or len(data) - len(data.translate(None, _CONTROL)) > MAX_CONTROL * len(data):
        raise DataError(f"{label}: binary data (NUL or control bytes), not text; list UTF-8 text or .jsonl files")
    text = data.decode("utf-8", errors="replace")
    invalid = text.count("\ufffd") - data.count("\ufffd".encode())
    if invalid > MAX_INVALID_UTF8 * len(data):
        raise DataError(
            f"{label}: not UTF-8 ({invalid} invalid sequences in {len(data)} bytes); "
            "convert it to UTF-8 (e.g. iconv -f latin1 -t UTF-8)"
        )
    return text


def read_text_file(path: Path, label: str | None = None) -> str:
    """Decoded text of ``path`` (see :func:`decode_text`); errors name ``label`` (default: the path)."""
    return decode_text(path.read_bytes(), str(path) if label is None else label)


def text_suffix(path: Path) -> str:
    """The suffix that says how to parse the text: ``docs.jsonl.gz`` -> ``.jsonl``."""
    return Path(path.stem).suffix if path.suffix in COMPRESSED_SUFFIXES else path.suffix
