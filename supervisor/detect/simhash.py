"""64-bit SimHash over character n-grams or feature sets, vectorised with numpy.

Two texts that share most of their n-grams land a few bits apart (`hamming`); the loop
detectors compare fingerprints of units and windows of a stream with earlier ones.
"""

from __future__ import annotations

import zlib

import numpy as np

_M = np.uint64(1000003)
_SM1 = np.uint64(0x9E3779B97F4A7C15)
_SM2 = np.uint64(0xBF58476D1CE4E5B9)
_SM3 = np.uint64(0x94D049BB133111EB)


def hamming(a: int, b: int) -> int:
    return (a ^ b).bit_count()


def fold(hashes: np.ndarray) -> int:
    """Sign of the per-bit vote over a set of 64-bit feature hashes → 64-bit fingerprint."""
    n = int(hashes.size)
    if n == 0:
        return 0
    bits = np.unpackbits(hashes.astype("<u8", copy=False).view(np.uint8))
    if n < 256:
        # Each bit is one byte here: summing the rows as 8 uint64 words adds 8 byte lanes at
        # once, and no lane can carry while fewer than 256 rows are summed.
        ones = bits.view(np.uint64).reshape(n, 8).sum(axis=0).view(np.uint8)
    else:
        ones = bits.reshape(n, 64).sum(axis=0, dtype=np.int64)
    return int.from_bytes(np.packbits(ones > (n >> 1)).tobytes(), "big")


def distinct(hashes: np.ndarray) -> np.ndarray:
    # Sort + neighbour compare: several times cheaper than np.unique's hash table for ~256.
    s = np.sort(hashes)
    keep = np.empty(s.size, dtype=bool)
    keep[:1] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


def fold_rows(grams: np.ndarray, starts: list[int], width: int) -> list[int]:
    """`fold(distinct(grams[s : s + width]))` for each start, in one pass of numpy calls
    (width < 256)."""
    rows = grams[np.asarray(starts)[:, None] + np.arange(width)]
    rows.sort(axis=1)
    keep = np.ones(rows.shape, dtype=bool)
    np.not_equal(rows[:, 1:], rows[:, :-1], out=keep[:, 1:])
    n = keep.sum(axis=1)
    seg = np.zeros(len(starts), dtype=np.intp)
    np.cumsum(n[:-1], out=seg[1:])
    # One bit per byte: 8 byte lanes per uint64 summed at once (as in fold; width < 256).
    lanes = np.unpackbits(rows[keep].astype("<u8", copy=False).view(np.uint8))
    ones = np.add.reduceat(lanes.view(np.uint64).reshape(-1, 8), seg, axis=0).view(np.uint8)
    packed = np.packbits(ones > (n >> 1)[:, None], axis=1)
    return [int.from_bytes(row.tobytes(), "big") for row in packed]


def mix(z: np.ndarray) -> np.ndarray:
    # Array arithmetic wraps silently (only numpy scalars warn): no errstate, it costs µs.
    z = z + _SM1
    z = (z ^ (z >> np.uint64(30))) * _SM2
    z = (z ^ (z >> np.uint64(27))) * _SM3
    out: np.ndarray = z ^ (z >> np.uint64(31))
    return out


def gram_hashes(text: str, n: int = 5) -> np.ndarray:
    """Mixed 64-bit hashes of every char n-gram of `text`, one per start position."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    if codes.size < n:
        return np.empty(0, dtype=np.uint64)
    h = codes[: codes.size - n + 1].copy()
    for j in range(1, n):
        h *= _M
        h += codes[j : codes.size - n + 1 + j]
    return mix(h)


def simhash_chars(text: str, n: int = 5) -> int:
    """64-bit SimHash over the set of char n-grams (stable across processes)."""
    if not text:
        return 0
    return fold(distinct(gram_hashes(text, min(n, len(text)))))


def feature_hash(feature: str) -> int:
    # Two CRC32s (C speed, stable across processes, unlike hash()) then a 64-bit mix.
    data = feature.encode()
    return zlib.crc32(data) | (zlib.crc32(data, 0x9E3779B9) << 32)


def simhash_features(features: set[str]) -> int:
    """64-bit SimHash over a set of string features (sets, not counts: research D §1.3)."""
    raw = np.fromiter((feature_hash(f) for f in features), dtype=np.uint64, count=len(features))
    return fold(mix(raw))
