"""Token ids of the simulator's tokenizer: the same in every process, so ids one replica's /tokenize made
read back on any other replica's /detokenize (as replicas of one vLLM model share one tokenizer).

A token is a piece of up to 4 characters (protocol.tokenize). Its id is the piece itself, written as a number:
each character's code point plus one is a digit in a fixed base (0 ends a shorter piece), so no table is
needed to read an id back. Three bases keep ids small for common text: pieces of ASCII get ids below 129**4
(about 2.8e8), pieces of code points below U+2000 (Latin, Greek, Cyrillic, Arabic, Indic scripts...) ids below
2**53 (exact in every JSON reader), pieces of code points below U+D700 (CJK, most Hangul) ids below 2**63.

Four arbitrary characters hold more than 63 bits, so a piece with a code point from U+D700 up (fullwidth forms,
emoji) gets a stable hash in the remaining ids, the same in every process; only a process that has made
such an id reads it back (it keeps the last HASHED of them).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

PIECE = 4  # characters per token, as protocol.tokenize cuts them
# (base, first id): a piece whose code points are all below base - 1 is written in that base from that id
TIERS: list[tuple[int, int]] = []
_start = 0
for _base in (129, 0x2001, 0xD701):
    TIERS.append((_base, _start))
    _start += _base ** PIECE
HASHED_FROM = _start  # ids from here to 2**63 are hashed pieces
HASH_SPACE = 2 ** 63 - HASHED_FROM
HASHED = 100_000
_hashed: OrderedDict[int, str] = OrderedDict()


def token_id(piece: str) -> int:
    """The id of a piece of 1 to 4 characters."""
    top = max(map(ord, piece))
    for base, start in TIERS:
        if top < base - 1:
            value = 0
            for char in reversed(piece):
                value = value * base + ord(char) + 1
            return start + value
    digest = hashlib.blake2b(piece.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    tid = HASHED_FROM + int.from_bytes(digest, "big") % HASH_SPACE
    _hashed[tid] = piece
    _hashed.move_to_end(tid)
    if len(_hashed) > HASHED:
        _hashed.popitem(last=False)
    return tid


def token_text(tid: int) -> str | None:
    """The piece an id stands for, or None for an id this tokenizer does not make (or a hashed one it has not
    made in this process)."""
    if tid < 0:
        return None
    if tid >= HASHED_FROM:
        return _hashed.get(tid)
    for base, start in reversed(TIERS):
        if tid >= start:
            value, chars = tid - start, []
            while value:
                value, digit = divmod(value, base)
                if digit == 0:
                    return None  # a gap: no piece is written with one
                chars.append(chr(digit - 1))
            piece = "".join(chars)
            # each piece has one id: the one from the smallest base that holds it
            return piece if piece and token_id(piece) == tid else None
    return None


def detokenize(ids: Sequence[object]) -> str | None:
    """The text of a list of ids, or None if any is not an id this tokenizer made."""
    pieces = []
    for tid in ids:
        piece = token_text(tid) if isinstance(tid, int) and not isinstance(tid, bool) else None
        if piece is None:
            return None
        pieces.append(piece)
    return "".join(pieces)
