"""JSON request bodies parsed in short steps and checked on the way (nesting depth, size, finite numbers, valid
Unicode), giving what json.loads gives. No step holds the interpreter lock for long, so a worker thread can parse
a maximal body while the event loop's thread keeps answering other requests.

json.loads (like pydantic) handles a whole body in one C call that holds the interpreter lock: a thread alone
does not help (a 64 MiB body of token ids is ~1.4 s of json.loads on a small box). Here every C call gets at most
STEP characters: runs of complete values are decoded by the C decoder in batches (a batch is taken only if the C
decoder accepts it whole, which proves it was cut between two values), the rest value by value.
"""

from __future__ import annotations

import codecs
import json
import math
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

STEP = 1 << 16  # characters (or bytes) one C call handles at most: about a millisecond
MAX_NUMBER_CHARS = 4300  # Python's own limit on integer digits; no JSON number a client sends is longer
# Arrays and objects in one body, and members of one object. Each container is an object the cyclic garbage
# collector walks in one go (~40 ns each) and a big dict is rehashed in one go as it grows: past these, a body
# would stall the whole process for tens of ms. A lookup's million sequences fit.
MAX_CONTAINERS = 1 << 20
MAX_MEMBERS = 1 << 20
# Characters of one string: a string is made in one go (a 64 Mi one is ~60 ms of page faults), and no text a
# client sends is longer than a model's context could take (~4 characters a token).
MAX_STRING_CHARS = 1 << 24

_WS = re.compile(r"[ \t\n\r]*")
_NUMBER = re.compile(r"[-+.0-9eE]*")
# Complete pieces of a JSON string's inside: plain characters and escapes (stops before a quote, a control
# character or a bad escape, so strict decoding reports those).
_STRING_PIECE = re.compile(r'(?:[^"\\\x00-\x1f]++|\\u[0-9a-fA-F]{4}|\\["\\/bfnrt])*+')
_HIGH_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}")
# What may stand for a lone surrogate: an escape of one (pairs too: they are then checked one by one) or a raw one
# (bytes decode with surrogatepass, as json.loads does).
_MAYBE_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]|[\ud800-\udfff]")
_CLOSER = {"[": "]", "{": "}"}
# json.decoder's string scanner (C in CPython); typeshed declares it only on the private _json module.
scanstring: Callable[[str, int, bool], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]
_SCALARS = frozenset({int, float, str, bool, type(None)})


class TooDeep(ValueError):
    """Nested deeper than allowed."""


class TooBig(ValueError):
    """More arrays and objects, members in one object or characters in one string than allowed."""


class Unsafe(ValueError):
    """A value the gateway never passes on: a non-finite number, a string that is not valid Unicode."""


class _NonFinite(Exception):
    def __init__(self, value: float):
        super().__init__(value)
        self.value = value


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 overflows to inf
        raise _NonFinite(value)
    return value


def _constant(name: str) -> float:
    raise _NonFinite(float(name))  # NaN, Infinity, -Infinity


def valid_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def decoded_parts(chunks: Sequence[bytes]) -> Iterator[str]:
    """The body (received in chunks) as text, STEP bytes at a time, in the encoding json.loads would detect."""
    head = b""
    for chunk in chunks:  # the encoding is told by the first 4 bytes
        head += chunk[:4]
        if len(head) >= 4:
            break
    decoder = codecs.getincrementaldecoder(json.detect_encoding(head))("surrogatepass")
    for chunk in chunks:
        for i in range(0, len(chunk), STEP):
            yield decoder.decode(chunk[i : i + STEP])
    yield decoder.decode(b"", final=True)


def parse(chunks: bytes | Sequence[bytes], max_depth: int) -> Any:
    """json.loads of the body, or TooDeep past max_depth levels, TooBig past MAX_CONTAINERS, MAX_MEMBERS or
    MAX_STRING_CHARS, Unsafe (naming the field) for a non-finite number or an invalid string, ValueError for a
    body that is not JSON (saying what and at which character)."""
    window = _Window(decoded_parts([chunks] if isinstance(chunks, bytes) else chunks))
    try:
        return _Parser(window, max_depth).document()
    except RecursionError as exc:  # only with a max_depth near the interpreter's recursion limit
        raise TooDeep(f"JSON nested too deeply to parse (limit {max_depth} levels)") from exc


class _Window:
    """The body's text seen a few STEPs at a time, from a position on: never the whole text in one string (for a
    64 MiB body that string alone is ~40 ms of page faults in one call, and 1-4x the body in memory)."""

    def __init__(self, parts: Iterator[str]):
        self.parts = parts
        self.text = ""
        self.base = 0  # the body position of text[0]
        self.done = False  # parts exhausted: text runs to the body's end

    def at(self, idx: int, ahead: int = STEP + 8) -> tuple[str, int]:
        """The text and idx's place in it, with at least `ahead` characters from idx on (fewer at the body's end).
        Text before idx may be dropped: positions taken from an earlier call are void after this one."""
        rel = idx - self.base
        if rel + ahead > len(self.text) and not self.done:
            pieces, have = [self.text[rel:]], len(self.text) - rel
            while have < ahead + STEP and not self.done:
                part = next(self.parts, None)
                if part is None:
                    self.done = True
                else:
                    pieces.append(part)
                    have += len(part)
            self.text, self.base, rel = "".join(pieces), idx, 0
        return self.text, rel

    def error(self, exc: json.JSONDecodeError) -> ValueError:
        """A C scanner's error on the window, with the position in the body."""
        return ValueError(f"{exc.msg} (char {self.base + exc.pos})")


def _end(pattern: re.Pattern[str], text: str, pos: int, endpos: int) -> int:
    match = pattern.match(text, pos, endpos)
    assert match is not None  # each pattern used here matches the empty string
    return match.end()


def dispose(box: list[Any]) -> None:
    """Free the value in `box` (its only holder) a step at a time: freeing 10M ints at once holds the interpreter
    lock for ~0.1 s. A container something else still holds is left to that holder."""
    stack = [box.pop()]
    while stack:
        item = stack[-1]
        # Held by: its slot in `stack`, `item`, getrefcount's argument; more means someone else holds it too.
        if not isinstance(item, list | dict) or not item or sys.getrefcount(item) > 3:
            stack.pop()
        elif isinstance(item, dict):
            values = list(item.values())
            item.clear()  # its keys: at most MAX_MEMBERS strings
            stack[-1] = values
            del values
        else:
            tail = item[-STEP:]
            del item[-STEP:]
            if not _SCALARS.issuperset(map(type, tail)):
                stack.extend(c for c in tail if type(c) in (list, dict))
            del tail  # frees up to STEP values


class _Parser:
    def __init__(self, window: _Window, max_depth: int):
        self.window = window
        self.max_depth = max_depth
        self.depth = 0
        self.containers = 0  # counted as '[' and '{' where the C decoder took a piece: strings' ones included
        self.path: list[str | int] = []  # where the value being parsed sits, for messages
        self.decoder = json.JSONDecoder(parse_float=_finite_float, parse_constant=_constant)
        # One value at a position, in C; JSONDecoder sets it up, typeshed does not declare it.
        self.scan: Callable[[str, int], tuple[Any, int]] = self.decoder.scan_once  # type: ignore[attr-defined]

    def document(self) -> Any:
        text, _ = self.window.at(0, STEP + 1)
        if self.window.done and len(text) <= STEP:  # a small body: one C call, unless something needs a look
            whole = self.decoded(text, 0)
            if whole is not None:
                return whole
        value, idx = self.value(self.ws(0))
        end = self.ws(idx)
        text, rel = self.window.at(end, 1)
        if rel < len(text):
            raise ValueError(f"Extra data (char {end})")
        return value

    def char(self, idx: int) -> str:
        text, rel = self.window.at(idx, 1)
        return text[rel : rel + 1]

    def ws(self, idx: int) -> int:
        while True:
            text, rel = self.window.at(idx)
            end = _end(_WS, text, rel, rel + STEP)
            if end < rel + STEP:
                return idx + end - rel
            idx += STEP

    def where(self, levels: int | None = None) -> str:
        """The field being parsed (with `levels`, the one that many levels up), as the gateway names it in its refusals."""
        out = ""
        for part in self.path[:levels]:
            out += f"[{part}]" if isinstance(part, int) else (f"{out and '.'}{part}")
        return out or "body"

    def value(self, idx: int) -> tuple[Any, int]:
        char = self.char(idx)
        if char in _CLOSER:
            return self.container(idx, char)
        if char == '"':
            return self.checked_string(idx + 1)
        text, rel = self.window.at(idx, MAX_NUMBER_CHARS + 1)
        if char and char in "-0123456789":
            if _end(_NUMBER, text, rel, rel + MAX_NUMBER_CHARS + 1) - rel > MAX_NUMBER_CHARS:
                raise ValueError(f"a number longer than {MAX_NUMBER_CHARS} characters (char {idx})")
        try:
            value, end = self.scan(text, rel)  # a number or a literal: short, in C
        except StopIteration:
            raise ValueError(f"Expecting value (char {idx})") from None
        except _NonFinite as exc:
            raise Unsafe(
                f"{self.where()}: {exc.value!r} is not a finite number; send a finite value"
            ) from None
        return value, idx + end - rel

    # --- arrays and objects ----------------------------------------------------------------------------------

    def container(self, idx: int, opener: str) -> tuple[Any, int]:
        text, rel = self.window.at(idx)
        end = text.find(_CLOSER[opener], rel, rel + STEP)
        if end != -1:  # it may end there: then it is small, one C call
            whole = self.decoded(text[rel : end + 1], 0)
            if whole is not None:
                return whole, idx + end + 1 - rel
        self.depth += 1
        self.count_containers(1)
        if self.depth > self.max_depth:
            raise TooDeep(f"JSON nested deeper than {self.max_depth} levels; flatten the request")
        self.path.append(0)
        try:
            return self.members(idx + 1, opener)
        finally:
            self.path.pop()
            self.depth -= 1

    def count_containers(self, more: int) -> None:
        self.containers += more
        if self.containers > MAX_CONTAINERS:
            raise TooBig(f"more than {MAX_CONTAINERS} JSON arrays and objects in one body; send fewer")

    def decoded(self, piece: str, wrapper: int) -> Any | None:
        """The value of `piece` if the C decoder takes it whole and nothing in it needs a closer look; `wrapper`:
        1 when the piece was wrapped in the brackets of the container being parsed."""
        openers = piece.count("[") + piece.count("{")
        if self.depth + openers - wrapper > self.max_depth:
            return None  # it may be too deep: the value-by-value parse finds out exactly
        if '"' not in piece and (
            piece.count("[") != piece.count("]") or piece.count("{") != piece.count("}")
        ):
            return None  # unbalanced: cut inside a nested value, or past the end of its own
        if _MAYBE_SURROGATE.search(piece):
            return None
        try:
            value = self.decoder.decode(piece)
        except (ValueError, _NonFinite, RecursionError):
            return None  # not whole, or something to report with its field's name: value by value
        self.count_containers(openers - wrapper)
        return value

    def members(self, idx: int, opener: str) -> tuple[Any, int]:
        closer = _CLOSER[opener]
        out: Any = [] if opener == "[" else {}
        idx = self.ws(idx)
        if self.char(idx) == closer:
            return out, idx + 1
        batch_after = idx  # no batch attempt before this position: the last one failed up to here
        try:
            while True:
                batch = self.batch(idx, opener) if idx >= batch_after else None
                if batch is None and idx >= batch_after:
                    batch_after = idx + STEP
                if batch is not None:
                    idx, values = batch
                    if isinstance(out, list):
                        out.extend(values)
                    else:
                        out.update(values)
                    del batch, values
                elif isinstance(out, list):
                    self.path[-1] = len(out)
                    value, idx = self.value(idx)
                    out.append(value)
                    del value  # `out` is its only holder: see the refusal below
                else:
                    key, idx = self.key(idx)
                    value, idx = self.value(idx)
                    out[key] = value
                    del value
                if isinstance(out, dict) and len(out) > MAX_MEMBERS:
                    raise TooBig(
                        f"{self.where(-1)}: more than {MAX_MEMBERS} members in one object; send fewer"
                    )
                idx = self.ws(idx)
                char = self.char(idx)
                if char == closer:
                    return out, idx + 1
                if char != ",":
                    raise ValueError(f"Expecting ',' delimiter (char {idx})")
                idx = self.ws(idx + 1)
        except BaseException:
            box = [out]  # a refused body's partial value is freed a step at a time too
            del out  # the traceback keeps this frame, and would keep `out` whole
            dispose(box)
            raise

    def batch(self, idx: int, opener: str) -> tuple[int, Any] | None:
        """The members from idx up to a cut within STEP characters, decoded in one C call, and the cut (a comma,
        or the container's end). A cut inside a string or a nested value leaves the piece unbalanced, which the
        decoder refuses; so does one past the container's end. None when no cut works."""
        closer = _CLOSER[opener]
        text, rel = self.window.at(idx)
        for cut in self.cuts(text, rel, min(rel + STEP, len(text)), closer):
            value = self.decoded(opener + text[rel:cut] + closer, 1)
            if value is not None:
                return idx + cut - rel, value
        return None

    @staticmethod
    def cuts(text: str, rel: int, limit: int, closer: str) -> list[int]:
        """Where the members may end: at the first closer (the container's own, if nothing nested comes
        first), at the last comma, or at the last comma right after a string, list or object."""
        found = [text.find(closer, rel, limit), text.rfind(",", rel, limit)]
        found += [i + 1 for i in (text.rfind(end + ",", rel, limit) for end in ('"', "]", "}")) if i != -1]
        return sorted({cut for cut in found if cut > rel}, key=found.index)

    def key(self, idx: int) -> tuple[str, int]:
        if self.char(idx) != '"':
            raise ValueError(f"Expecting property name enclosed in double quotes (char {idx})")
        key, idx = self.string(idx + 1)
        if not key.isascii() and not valid_unicode(key):
            raise Unsafe(f"{self.where(-1)}: a key is not valid Unicode (a lone surrogate escape)")
        self.path[-1] = key
        idx = self.ws(idx)
        if self.char(idx) != ":":
            raise ValueError(f"Expecting ':' delimiter (char {idx})")
        return key, self.ws(idx + 1)

    # --- strings ---------------------------------------------------------------------------------------------

    def checked_string(self, idx: int) -> tuple[str, int]:
        value, end = self.string(idx)
        if not value.isascii() and not valid_unicode(value):
            raise Unsafe(
                f"{self.where()}: the string is not valid Unicode (a lone surrogate escape); send UTF-8 text"
            )
        return value, end

    def string(self, idx: int) -> tuple[str, int]:
        """The string whose text starts at idx (after its opening quote), decoded STEP characters at a time
        (STEP >= 12: a surrogate pair's two escapes fit in one piece)."""
        text, rel = self.window.at(idx)
        quote = text.find('"', rel, rel + STEP)
        if quote != -1 and text.find("\\", rel, quote) == -1:
            value, end = scanstring(text, rel, True)  # short and without escapes: ends at that quote
            return value, idx + end - rel
        parts: list[str] = []
        start = idx
        while True:
            text, rel = self.window.at(idx)
            end = _end(_STRING_PIECE, text, rel, rel + STEP)
            # Short of the window by more than an escape's length: at the closing quote, or at what strict
            # decoding refuses (it says what), or at the body's end.
            if end <= rel or end < rel + STEP - 6 or text.startswith('"', end) or end >= len(text):
                try:
                    last, after = scanstring(text, rel, True)
                except json.JSONDecodeError as exc:
                    if exc.msg.startswith("Unterminated"):
                        raise ValueError(f"Unterminated string starting at char {start - 1}") from None
                    raise self.window.error(exc) from None
                parts.append(last)
                return "".join(parts), idx + after - rel
            if (
                end - 6 > rel
                and _HIGH_SURROGATE_ESCAPE.match(text, end - 6, end)
                and _escapes(text, end - 6, rel)
            ):
                end -= 6  # keep a surrogate pair's halves in one piece
            parts.append(scanstring(text[rel:end] + '"', 0, True)[0])
            idx += end - rel
            if idx - start > MAX_STRING_CHARS:
                raise TooBig(f"{self.where()}: a string longer than {MAX_STRING_CHARS} characters; send less")


def _escapes(text: str, pos: int, start: int) -> bool:
    """Whether the backslash at pos starts an escape (it is not the second of an escaped backslash); `start` is
    a position known to be outside any escape."""
    run = 0
    while pos - run >= start and text[pos - run] == "\\":
        run += 1
    return run % 2 == 1
