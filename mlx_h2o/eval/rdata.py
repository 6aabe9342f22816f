"""Read R serialization (XDR, format versions 2 and 3) without R.

Covers what R data packages hold: character, integer, logical, double and raw
vectors, lists, pairlists with attributes, symbols and references, the compact
ALTREP classes R writes for ``1:n`` and wrapped vectors, and lazy-load
databases (``.rdx`` index + ``.rdb`` blobs, the layout of ``data/Rdata.*``).

Mapping to Python: NULL -> None; character vectors -> ``RObject("character",
list[str | None])``; integer/logical -> int32 numpy arrays (NA is ``NA_INTEGER``);
double -> float64 numpy arrays; raw -> bytes; lists -> ``RObject("list", [...])``;
pairlists -> ``RObject("pairlist", [(tag, value), ...])``; symbols -> ``RSymbol``.
Attributes (names, class, ...) come as a dict on ``RObject.attributes``.
"""

import bz2
import codecs
import gzip
import lzma
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

NA_INTEGER = -(2**31)

# SEXP types (R Internals, "Serialization formats").
NILSXP, SYMSXP, LISTSXP, CLOSXP, ENVSXP, PROMSXP, LANGSXP = 0, 1, 2, 3, 4, 5, 6
CHARSXP, LGLSXP, INTSXP, REALSXP, CPLXSXP, STRSXP, DOTSXP = 9, 10, 13, 14, 15, 16, 17
VECSXP, EXPRSXP, RAWSXP, S4SXP = 19, 20, 24, 25
REFSXP, NILVALUE_SXP, PERSISTSXP, ALTREP_SXP = 255, 254, 247, 238
NAMESPACESXP, PACKAGESXP = 249, 248
SPECIALS = {253: "globalenv", 252: "unboundvalue", 251: "missingarg",
            250: "basenamespace", 242: "emptyenv", 241: "baseenv"}  # fmt: skip
PAIRLIST_KINDS = {LISTSXP: "pairlist", LANGSXP: "language", CLOSXP: "closure",
                  PROMSXP: "promise", DOTSXP: "dots"}  # fmt: skip
VECTOR_KINDS = {LGLSXP: "logical", INTSXP: "integer", REALSXP: "double",
                CPLXSXP: "complex", STRSXP: "character", VECSXP: "list",
                EXPRSXP: "expression", RAWSXP: "raw", S4SXP: "S4"}  # fmt: skip
# CHARSXP "levels" bits giving the string's encoding.
BYTES_MASK, LATIN1_MASK, UTF8_MASK, ASCII_MASK = 1 << 1, 1 << 2, 1 << 3, 1 << 6


class RDataError(ValueError):
    """Raised on malformed or unsupported R serialized data."""


class RSymbol(str):
    """An R symbol (a name such as ``names`` or ``class``)."""


@dataclass
class RObject:
    """An R object: ``kind`` (R's type name), ``value`` and ``attributes``."""

    kind: str
    value: Any = None
    attributes: dict[str, Any] = field(default_factory=dict)

    @property
    def names(self) -> list[str | None] | None:
        """The ``names`` attribute as a list of strings, or None."""
        names = self.attributes.get("names")
        return None if names is None else list(names.value)


class _Reader:
    """One pass over one serialized stream; ``refs`` is R's reference table."""

    def __init__(self, data: bytes):
        self.data, self.pos, self.refs = data, 0, []
        self.native_encoding = "utf-8"

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise RDataError(f"truncated R data: need {n} bytes at {self.pos}")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def int(self) -> int:
        return struct.unpack(">i", self.take(4))[0]

    def length(self) -> int:
        n = self.int()
        if n == -1:  # long vector: two more ints, upper then lower 32 bits
            upper, lower = self.int(), self.int()
            n = (upper << 32) + (lower & 0xFFFFFFFF)
        return n

    def header(self) -> None:
        fmt = self.take(2)
        if fmt != b"X\n":
            raise RDataError(
                f"only XDR ('X\\n') R serialization is supported, got {fmt!r}"
            )
        version = self.int()
        self.int(), self.int()  # writer's R version, minimal R version to read
        if version == 3:
            encoding = self.take(self.int()).decode("ascii")
            try:
                self.native_encoding = codecs.lookup(encoding).name
            except LookupError:
                self.native_encoding = (
                    "utf-8"  # R's default; only untagged strings use it
                )
        elif version != 2:
            raise RDataError(f"unsupported R serialization version {version}")

    def item(self) -> Any:
        return self.with_flags(self.int())

    def with_flags(self, flags: int) -> Any:
        sexptype, levels = flags & 0xFF, flags >> 12
        if sexptype == NILVALUE_SXP:
            return None
        if sexptype in SPECIALS:
            return RObject(SPECIALS[sexptype])
        if sexptype == REFSXP:
            index = flags >> 8 or self.int()
            return self.refs[index - 1]
        if sexptype == SYMSXP:
            symbol = RSymbol(self.item() or "")
            self.refs.append(symbol)
            return symbol
        if sexptype in (PERSISTSXP, NAMESPACESXP, PACKAGESXP):
            kind = {PERSISTSXP: "persist", NAMESPACESXP: "namespace"}
            obj = RObject(kind.get(sexptype, "package"), self.string_vector())
            self.refs.append(obj)
            return obj
        if sexptype == ENVSXP:
            return self.environment()
        if sexptype in PAIRLIST_KINDS:
            return self.pairlist(flags)
        if sexptype == CHARSXP:
            return self.charsxp(levels)
        if sexptype == ALTREP_SXP:
            return self.altrep()
        if sexptype not in VECTOR_KINDS:
            raise RDataError(f"unsupported R SEXP type {sexptype}")
        obj = RObject(VECTOR_KINDS[sexptype], self.vector(sexptype))
        if flags & (1 << 9):
            obj.attributes = self.attributes()
        return obj

    def vector(self, sexptype: int) -> Any:
        if sexptype == S4SXP:
            return None
        n = self.length()
        if sexptype in (LGLSXP, INTSXP):
            return np.frombuffer(self.take(4 * n), ">i4").astype(np.int32)
        if sexptype == REALSXP:
            return np.frombuffer(self.take(8 * n), ">f8").astype(np.float64)
        if sexptype == CPLXSXP:
            return np.frombuffer(self.take(16 * n), ">c16").astype(np.complex128)
        if sexptype == RAWSXP:
            return self.take(n)
        return [self.item() for _ in range(n)]  # STRSXP, VECSXP, EXPRSXP

    def charsxp(self, levels: int) -> str | bytes | None:
        n = self.int()
        if n == -1:
            return None  # NA_character_
        raw = self.take(n)
        if levels & BYTES_MASK:
            return raw
        if levels & LATIN1_MASK:
            return raw.decode("latin-1")
        if levels & (UTF8_MASK | ASCII_MASK):
            return raw.decode("utf-8")
        return raw.decode(self.native_encoding, errors="replace")

    def string_vector(self) -> list[Any]:
        if self.int() != 0:
            raise RDataError("names in persistent string vectors are not supported")
        return [self.item() for _ in range(self.int())]

    def attributes(self) -> dict[str, Any]:
        attrs = self.item()
        if not isinstance(attrs, RObject) or attrs.kind != "pairlist":
            raise RDataError("attributes must be a pairlist")
        return {str(tag): value for tag, value in attrs.value}

    def pairlist(self, flags: int) -> RObject:
        # Iterative over the CDR chain: long pairlists must not recurse.
        obj, cells = RObject(PAIRLIST_KINDS[flags & 0xFF]), []
        while (flags & 0xFF) in PAIRLIST_KINDS:
            if flags & (1 << 9):
                attrs = self.attributes()
                obj.attributes = obj.attributes or attrs
            tag = self.item() if flags & (1 << 10) else None
            cells.append((tag, self.item()))
            flags = self.int()
        tail = self.with_flags(flags)
        if tail is not None:  # a dotted pair: keep the tail as a last, untagged cell
            cells.append((None, tail))
        obj.value = cells
        return obj

    def environment(self) -> RObject:
        obj = RObject("environment", {})
        self.refs.append(obj)
        self.int()  # locked
        enclos, frame, hashtab, attrs = (self.item() for _ in range(4))
        for bindings in [frame] + list(getattr(hashtab, "value", None) or []):
            for tag, value in getattr(bindings, "value", None) or []:
                obj.value[str(tag)] = value
        obj.attributes = {str(t): v for t, v in getattr(attrs, "value", None) or []}
        obj.attributes["__enclos__"] = enclos
        return obj

    def altrep(self) -> RObject:
        info, state, attrs = self.item(), self.item(), self.item()
        cls = str(info.value[0][1])
        if cls in ("compact_intseq", "compact_realseq"):
            n, start, step = (float(x) for x in state.value)
            values = start + step * np.arange(int(n))
            dtype = np.int32 if cls == "compact_intseq" else np.float64
            obj = RObject(
                "integer" if dtype is np.int32 else "double", values.astype(dtype)
            )
        elif cls.startswith("wrap_"):
            obj = RObject(state.value[0].kind, state.value[0].value)
        elif cls == "deferred_string":
            source = state.value[0][1]
            obj = RObject(
                "character", [_format_number(x, source.kind) for x in source.value]
            )
        else:
            raise RDataError(f"unsupported ALTREP class {cls!r}")
        obj.attributes = {str(t): v for t, v in getattr(attrs, "value", None) or []}
        return obj


def _format_number(x: Any, kind: str) -> str | None:
    if kind == "integer":
        return None if x == NA_INTEGER else str(int(x))
    return None if np.isnan(x) else repr(float(x)).removesuffix(".0")


def unserialize(data: bytes) -> Any:
    """Decode one R serialized object (what R's ``serialize()`` writes, XDR)."""
    reader = _Reader(data)
    reader.header()
    return reader.item()


def decompress_file_bytes(raw: bytes) -> bytes:
    """Undo the gzip, bzip2 or xz compression that ``saveRDS`` applies, if any."""
    if raw[:2] == b"\x1f\x8b":
        return gzip.decompress(raw)
    if raw[:3] == b"BZh":
        return bz2.decompress(raw)
    if raw[:6] == b"\xfd7zXZ\x00":
        return lzma.decompress(raw)
    return raw


def read_rds(path: str | Path) -> Any:
    """Read an ``.rds`` file (``saveRDS``), compressed or not."""
    return unserialize(decompress_file_bytes(Path(path).read_bytes()))


def _unxz(payload: bytes) -> bytes:
    # R writes a raw LZMA2 stream (no .xz container), preset 9: 64 MiB dictionary.
    lzma2 = {"id": lzma.FILTER_LZMA2, "dict_size": 1 << 26}
    return lzma.decompress(payload, format=lzma.FORMAT_RAW, filters=[lzma2])


def _decompress_blob(blob: bytes, compressed: int) -> bytes:
    """Undo a lazy-load blob's compression: 4-byte length, [type byte,] payload."""
    (size,) = struct.unpack(">I", blob[:4])
    kind, payload = (b"1", blob[4:]) if compressed == 1 else (blob[4:5], blob[5:])
    codecs = {b"0": bytes, b"1": zlib.decompress, b"2": bz2.decompress, b"Z": _unxz}
    if kind not in codecs:
        raise RDataError(f"unknown lazy-load compression type {kind!r}")
    out = codecs[kind](payload)
    if len(out) != size:
        raise RDataError(
            f"lazy-load blob expands to {len(out)} bytes, header says {size}"
        )
    return out


def read_lazyload(
    stem: str | Path, names: Iterable[str] | None = None
) -> dict[str, Any]:
    """Read variables of an R lazy-load database (``stem.rdx`` + ``stem.rdb``).

    Args:
        stem: path without extension, e.g. ``.../janeaustenr/data/Rdata``.
        names: variables to read (default: all, in index order).

    Returns:
        A dict from variable name to decoded object.
    """
    stem = Path(stem)
    index = read_rds(stem.with_suffix(".rdx"))
    parts = dict(zip(index.names, index.value))
    variables, compressed = parts["variables"], int(parts["compressed"].value[0])
    offsets = dict(zip(variables.names, variables.value))
    wanted = list(offsets) if names is None else list(names)
    missing = [n for n in wanted if n not in offsets]
    if missing:
        raise KeyError(f"{missing} not in {stem}.rdx (has {sorted(offsets)})")
    out = {}
    with open(stem.with_suffix(".rdb"), "rb") as db:
        for name in wanted:
            start, length = (int(x) for x in offsets[name].value)
            db.seek(start)
            out[name] = unserialize(_decompress_blob(db.read(length), compressed))
    return out
