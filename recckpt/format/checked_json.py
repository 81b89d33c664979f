"""The one JSON parser for bytes read from a checkpoint, and the metadata files that carry their own checksum.

`parse` is bounded: the caller's byte cap, a nesting depth, a length for every number, string keys
that appear once per object, text that is valid Unicode. Whatever the input, it returns a value or
raises CorruptCheckpointError naming the file; nothing else escapes (no RecursionError, no ValueError).
Every JSON text recckpt reads (manifest, indexes, safetensors headers, state trees) goes through it.

A checked file is a JSON object with a key "crc32c": the CRC-32C of the canonical serialisation of the
object without that key (keys sorted, no whitespace, ASCII only, integers only — no floats, so every
language serialises it to the same bytes). Any flipped byte either breaks parsing or the checksum.
"""
from __future__ import annotations

import functools
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .. import _C
from ..errors import CorruptCheckpointError

CRC_KEY = "crc32c"

#: Nesting limit of every JSON text: the deepest file recckpt writes (an index) nests 7 deep, and
#: state trees (extras, IO state) are refused at save time beyond this (tree_codec), so a deeper text
#: is hostile. Python's own recursion limit (about 1000) stays far away.
MAX_DEPTH = 200
#: Characters of one number: an int64 or uint64 takes at most 20; 40 leaves room for a float's
#: digits and exponent. Longer numbers cost quadratic time to convert, so they are refused first.
MAX_NUMBER_CHARS = 40


@dataclass(frozen=True)
class JsonLimits:
    """What one kind of file may contain. `max_bytes` is the file-type cap (names.py)."""
    max_bytes: int
    max_depth: int = MAX_DEPTH
    floats: bool = False   # checked files are integer-only; state trees may hold floats

    def __post_init__(self):
        if not (isinstance(self.max_bytes, int) and self.max_bytes >= 0):
            raise ValueError(f"JsonLimits.max_bytes must be an integer >= 0, got {self.max_bytes!r}")
        if not (isinstance(self.max_depth, int) and 1 <= self.max_depth <= MAX_DEPTH):
            raise ValueError(f"JsonLimits.max_depth must be in [1, {MAX_DEPTH}], got {self.max_depth!r}")


class JsonRuleError(ValueError):
    """A JSON value breaks a rule of `parse` (depth, keys, numbers, text); `parse` turns it into
    CorruptCheckpointError, writers into an error at save time."""


def parse(data, path: str, limits: JsonLimits, precheck=None):
    """Parse JSON `data` (bytes, or str) read from file `path` within `limits`. `precheck(obj)`, if given,
    runs on the decoded value before the rules are checked, to refuse a hostile file early (it must
    raise CorruptCheckpointError or nothing, whatever shape `obj` has)."""
    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: not valid checkpoint metadata ({why})", path)

    if len(data) > limits.max_bytes:
        raise CorruptCheckpointError(f"{path}: {len(data)} bytes exceeds the {limits.max_bytes}-byte cap for "
                                     f"this kind of metadata; the file is corrupt or not a recckpt file", path)
    try:
        text = data if isinstance(data, str) else bytes(data).decode("utf-8")
        # int() of a long digit string costs quadratic time. Python bounds it (int_max_str_digits, 4300
        # digits by default: a longer number fails the parse), so integers are converted by json itself
        # and their size is checked afterwards, in bulk (check_tree); a hook per integer would cost a
        # Python call each and make a large index parse several times slower than json.loads. Where
        # the interpreter's bound is off, the hook checks every number's length first.
        hook = _int if _UNBOUNDED_INT_PARSE else None
        raw = data if isinstance(data, (bytes, bytearray)) else text
        decode = functools.partial(json.loads, parse_int=hook, parse_float=_float if limits.floats else _no_float,
                                   parse_constant=_no_constant)
        with _RulesPass(raw, limits.max_depth) as verdict:
            # Where the engine's pass saw every key unique, json decodes without a Python call per object
            # (the key hook took four fifths of a 1000-table manifest's parse). A small text's verdict comes
            # first; a large text is decoded while its pass runs, and again with the hook unless the verdict
            # is "follows", so that both give the same value or the same error.
            if verdict.threaded:
                try:
                    obj, failed = decode(text), None
                except (ValueError, TypeError, RecursionError, MemoryError) as e:
                    obj, failed = None, e
                v = verdict()
                if v != _C.JSON_FOLLOWS:
                    obj = None   # (one decoded tree in memory at a time)
                    obj = decode(text, object_pairs_hook=_unique_keys)
                elif failed is not None:
                    raise failed
            else:
                v = verdict()
                obj = decode(text) if v == _C.JSON_FOLLOWS else decode(text, object_pairs_hook=_unique_keys)
            if precheck is not None:
                precheck(obj)
            if v == _C.JSON_LOOK_CLOSER:
                check_tree(obj, limits.max_depth)   # finds the problem (or that there is none) and words it
    except JsonRuleError as e:
        raise bad(str(e)) from None
    except (UnicodeError, ValueError, TypeError) as e:
        if "digits" in str(e) and "integer" in str(e):   # Python's int_max_str_digits bound
            raise bad(f"a number of more than {MAX_NUMBER_CHARS} digits") from None
        raise bad(f"{type(e).__name__}: {e}"[:300]) from None
    except RecursionError:  # the C scanner's own guard, far deeper than max_depth
        raise bad(f"nested more than {limits.max_depth} deep") from None
    except MemoryError:
        raise bad("too large to parse") from None
    return obj


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


#: A checked file whose canonical form is larger than this is written compact: Python serialises
#: indented JSON in Python code, several times slower than compact (the manifest of a thousand tables).
INDENT_BELOW = 64 << 10


def dumps(obj: dict, check: bool = True) -> bytes:
    """A checked file's bytes. `check=False`: the caller parses them back with `loads` itself (which
    applies the same rules), so the key and depth rules are not checked twice."""
    if CRC_KEY in obj:
        raise ValueError(f"metadata must not contain the key {CRC_KEY!r}")
    if check:
        check_tree(obj, MAX_DEPTH)  # what we write, we can read back: same key rules and depth
    # The canonical form member by member (keys sorted, as json's sort_keys sorts them), so that a large
    # file, written compact, is those members with the checksum's added: serialised once, not twice.
    members = [(k, _canonical_str(k) + ":" + _canonical_str(v)) for k, v in sorted(obj.items())]
    body = ("{" + ",".join(m for _, m in members) + "}").encode("ascii")
    crc = _C.crc32c(body)
    if len(body) >= INDENT_BELOW:
        at = next((i for i, (k, _) in enumerate(members) if k > CRC_KEY), len(members))
        members.insert(at, (CRC_KEY, f'"{CRC_KEY}":{crc}'))
        return ("{" + ",".join(m for _, m in members) + "}").encode("ascii")
    # Human-readable on disk when small; the checksum is over the canonical form, not these bytes.
    out = dict(obj)
    out[CRC_KEY] = crc
    return json.dumps(out, sort_keys=True, indent=1, ensure_ascii=True, allow_nan=False).encode("ascii")


def _canonical_str(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def loads(data: bytes, path: str, max_bytes: int, precheck=None) -> dict:
    """Parse and verify a checked JSON file; CorruptCheckpointError names `path` on any defect.
    `precheck`: see `parse` (it runs before the self-checksum is recomputed too)."""
    if len(data) > max_bytes:
        raise CorruptCheckpointError(f"{path}: {len(data)} bytes exceeds the {max_bytes}-byte cap for this kind "
                                     f"of metadata; the file is corrupt or not a recckpt file", path)
    obj = parse(ascii_text(data, path), path, JsonLimits(max_bytes), precheck)
    if not isinstance(obj, dict) or type(obj.get(CRC_KEY)) is not int:
        raise CorruptCheckpointError(f"{path}: metadata has no integer {CRC_KEY!r} field", path)
    crc = obj.pop(CRC_KEY)
    if _crc_of_compact(data, crc) == crc:
        return obj
    # parse() bounded the depth, so the canonical re-serialisation cannot run out of stack.
    actual = _C.crc32c(canonical(obj))
    if actual != crc:
        raise CorruptCheckpointError(f"{path}: checksum mismatch (recorded {crc:#x}, computed "
                                     f"{actual:#010x}); the file is corrupt", path)
    return obj


def _crc_of_compact(data, crc: int) -> int | None:
    """The CRC-32C of `data` without its first `"crc32c":<crc>` member, or None where it has none. A
    large checked file is written compact (`dumps`): its bytes are then the canonical form with that
    member added, so this is the checksum `loads` wants, without serialising the parsed object again
    (a manifest of a thousand tables). Any other text (indented, or not as written) does not give the
    recorded CRC this way, and is checked against its canonical form as ever."""
    raw = data.encode("ascii") if isinstance(data, str) else bytes(data)
    member = b'"%s":%d' % (CRC_KEY.encode(), crc)
    i = raw.find(member)
    if i < 0:
        return None
    j = i + len(member)
    if raw[j:j + 1] == b",":
        j += 1
    elif raw[i - 1:i] == b",":
        i -= 1
    return _C.crc32c(raw[j:], _C.crc32c(raw[:i]))


def dumps_unchecked(obj: dict, check: bool = True) -> bytes:
    """A metadata file without a self-checksum (format version 4's indexes: the manifest records the
    size and CRC of their bytes). Compact: these files grow with the segments. `check=False`: the
    caller has the same text checked elsewhere (see `dumps`)."""
    if CRC_KEY in obj:
        raise ValueError(f"metadata must not contain the key {CRC_KEY!r}")
    if check:
        check_tree(obj, MAX_DEPTH)
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def ascii_text(data, path: str) -> str:
    """Metadata bytes as text, in one pass that also checks they are ASCII (checked files are)."""
    if isinstance(data, str):
        if not data.isascii():
            raise CorruptCheckpointError(f"{path}: not valid checkpoint metadata (non-ASCII text)", path)
        return data
    try:
        return bytes(data).decode("ascii")
    except UnicodeDecodeError:
        raise CorruptCheckpointError(f"{path}: not valid checkpoint metadata (non-ASCII bytes; checked "
                                     f"files are ASCII)", path) from None


def loads_unchecked(data: bytes, path: str, max_bytes: int) -> dict:
    """Parse a metadata file that `dumps_unchecked` wrote (its bytes already checked against the
    manifest): the rules of `parse`, an ASCII object, no self-checksum to recompute."""
    if len(data) > max_bytes:
        raise CorruptCheckpointError(f"{path}: {len(data)} bytes exceeds the {max_bytes}-byte cap for this kind "
                                     f"of metadata; the file is corrupt or not a recckpt file", path)
    obj = parse(ascii_text(data, path), path, JsonLimits(max_bytes))
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"{path}: not valid checkpoint metadata (not a JSON object)", path)
    return obj


class _RulesPass:
    """`_text_verdict` of a large text on a thread while json decodes it (the engine's pass lets go
    of the GIL): a 245 MB hostile index was refused in ~2x a plain json.loads, 0.28 s of it this pass.
    Used as `with _RulesPass(text, depth) as follows_rules: ... follows_rules()`; leaving the block waits
    for the thread whatever happened inside it. Small texts are checked in line, when asked."""

    THREAD_FROM = 1 << 20

    def __init__(self, text: "bytes | str", max_depth: int):
        self._text, self._depth, self._pool, self._future = text, max_depth, None, None

    def __enter__(self):
        if len(self._text) >= self.THREAD_FROM:
            self._pool = ThreadPoolExecutor(1)
            self._future = self._pool.submit(_text_verdict, self._text, self._depth)
        return self

    @property
    def threaded(self) -> bool:
        return self._future is not None

    def __call__(self) -> int:
        if self._future is None:
            return _text_verdict(self._text, self._depth)
        return self._future.result()

    def __exit__(self, *exc):
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        return False


def _text_verdict(text: "bytes | str", max_depth: int) -> int:
    """Whether JSON `text` surely follows check_tree's rules and has no key twice in an object, by the
    engine's one pass over the text (`_C.json_rules_verdict`; conservative: JSON_LOOK_CLOSER or
    JSON_KEYS_UNKNOWN mean look closer). Much cheaper than walking the decoded tree in Python, which the
    metadata of a thousand tables makes a few hundred thousand values."""
    return _C.json_rules_verdict(text, max_depth, MAX_NUMBER_CHARS)   # (a str is read in place, not copied)


def check_tree(obj, max_depth: int = MAX_DEPTH) -> None:
    """Depth and key rules, without recursion (a hostile text must not exhaust the stack here either);
    raises JsonRuleError. Writers call it too, so that what recckpt writes it can read back."""
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
            for k in node:
                if type(k) is not str:
                    raise JsonRuleError(f"object key {k!r:.40} is not a string")
                _check_text(k)
        elif isinstance(node, list):
            kinds = set(map(type, node))   # in C: an index's long lists of integers cost no Python loop
            if kinds <= {int, bool}:
                if node and kinds == {int} and not -_INT_BOUND < min(node) <= max(node) < _INT_BOUND:
                    raise JsonRuleError(f"a number of more than {MAX_NUMBER_CHARS} digits")
                if depth > max_depth:
                    raise JsonRuleError(f"nested more than {max_depth} deep")
                continue
            children = node
        else:
            if type(node) is str:
                _check_text(node)
            elif type(node) is int and not -_INT_BOUND < node < _INT_BOUND:
                raise JsonRuleError(f"a number of more than {MAX_NUMBER_CHARS} digits")
            continue
        if depth > max_depth:
            raise JsonRuleError(f"nested more than {max_depth} deep")
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list, str, int)))


def _check_text(s: str) -> None:
    # JSON escapes can spell lone surrogates (\ud800), which are not Unicode text: file names and
    # keys built from them could not be written back or compared with what a writer produced.
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise JsonRuleError(f"string {s!r:.40} is not valid Unicode (lone surrogate)") from None


def _unique_keys(pairs):
    d = dict(pairs)
    if len(d) != len(pairs):
        seen = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise JsonRuleError(f"key {dup!r:.40} appears twice in one object")
    return d


#: Python without a bound on int() of a digit string (int_max_str_digits 0, or before 3.11).
_UNBOUNDED_INT_PARSE = not getattr(sys, "get_int_max_str_digits", lambda: 0)()
#: Integers check_tree accepts: at most MAX_NUMBER_CHARS digits.
_INT_BOUND = 10 ** MAX_NUMBER_CHARS


def _int(text: str) -> int:
    if len(text) > MAX_NUMBER_CHARS:
        raise JsonRuleError(f"a {len(text)}-character number (at most {MAX_NUMBER_CHARS})")
    return int(text)


def _float(text: str) -> float:
    if len(text) > MAX_NUMBER_CHARS:
        raise JsonRuleError(f"a {len(text)}-character number (at most {MAX_NUMBER_CHARS})")
    v = float(text)
    if v in (float("inf"), float("-inf")):  # 1e999: not a number JSON can carry back
        raise JsonRuleError(f"number {text!r} overflows a float")
    return v


def _no_float(text):
    raise JsonRuleError(f"unexpected non-integer number {text[:MAX_NUMBER_CHARS]!r}")


def _no_constant(name):
    raise JsonRuleError(f"{name} is not JSON")
