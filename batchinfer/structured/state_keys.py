"""Grammar-state keys of JSON answers: equal keys mean equal grammar states, so equal next-token masks.

A grammar library's state is a function of its compiled grammar and the bytes accepted so far, so
the answer's text is always a sound key. It rarely repeats between rows, though, and llguidance
cannot reuse a mask across its matchers: inside a string with a maxLength every position is a new
lexer state, and each costs a walk of the whole token trie (0.1-0.2 ms on a 151k vocabulary, up to
3 ms near the bound). This module makes the key coarser where the schema says the state does not
depend on the text:

- inside a *free* string (a schema position whose schema is only `type: string` with maxLength /
  minLength and annotations) the state depends only on how many characters the string holds and
  on an unfinished UTF-8 character, not on which characters: the key is the text before the opening
  quote, the character count and those pending bytes. A string with an escape falls back to its
  text until it closes (llguidance counts an escape as one character, and the key need not know);
- once a free string or a plain number (`type: integer|number` with bounds) is complete, its
  content no longer matters to what may follow: the key keeps `""` and `0` in its place;
- the same holds for ANY complete scalar value (an enum or pattern string, a number, true / false /
  null, a value under anyOf) that is a property or item of a container this module follows (an
  object or array whose schema has only the keywords of CONTAINER): what may follow it depends on
  the container's schema, the keys written and the item count, which all stay in the key, not on
  the value. (A container with any other keyword, such as uniqueItems, dependentRequired, if or
  anyOf, is not followed: its values stay as written.)

Everything else (object keys, strings and numbers in progress that are not free, containers this
module does not follow, anything under anyOf/oneOf/allOf/if/not/$ref that leaves this file, unknown
keywords) stays in the key as written, so a schema this module does not understand only costs
sharing, never correctness. The counting rules are those of llguidance (maxLength counts code
points, an escape is one): keys are only made for grammars it compiled (GrammarState), and tests
check the masks of equal keys against fresh matchers.

SchemaKeys(schema) is built once per constraint; start() gives one answer's KeyTrack, whose feed()
takes each accepted token's bytes and whose key() is hashable (None once the text left the JSON
this tracker follows: that row is then filled on its own). TextTrack is the plain key, the text
itself, for every other grammar and library (their states are functions of the bytes too).
"""

from __future__ import annotations

import json
from typing import Any

ANNOTATIONS = frozenset({"title", "description", "examples", "default", "$comment", "deprecated", "readOnly",
                         "writeOnly", "$schema", "$id", "$defs", "definitions"})
FREE_STRING = frozenset({"type", "maxLength", "minLength"}) | ANNOTATIONS
PLAIN_NUMBER = frozenset({"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}) | ANNOTATIONS
CONTAINER = frozenset({"type", "properties", "required", "additionalProperties", "minProperties", "maxProperties",
                       "items", "prefixItems", "minItems", "maxItems", "$ref"}) | ANNOTATIONS
WHITESPACE = frozenset(b" \t\n\r")
NUMBER_BYTES = frozenset(b"0123456789+-.eE")
LITERALS = (b"true", b"false", b"null")

# positions a container expects next
KEY_OR_CLOSE, KEY, COLON, VALUE, COMMA_OR_CLOSE, VALUE_OR_CLOSE, DONE = range(7)


def _types(node: dict) -> tuple:
    t = node.get("type")
    return tuple(t) if isinstance(t, list) else (t,)


class SchemaKeys:
    """What one schema says about its positions (module docstring); start() tracks one answer."""

    def __init__(self, schema: Any) -> None:
        self.root = schema
        self._free: dict[int, bool] = {}

    def start(self) -> KeyTrack:
        return KeyTrack(self)

    # --- schema positions: a dict node, or None where this module does not follow the schema ---

    def resolve(self, node: Any, depth: int = 0) -> dict | None:
        if node is True:
            return {}
        if not isinstance(node, dict) or depth > 32:
            return None
        ref = node.get("$ref")
        if ref is None:
            return node
        if len(node.keys() - ANNOTATIONS - {"$ref"}) or not isinstance(ref, str) or not ref.startswith("#"):
            return None
        target: Any = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                return None
        return self.resolve(target, depth + 1)

    @staticmethod
    def follows(node: dict | None) -> bool:
        """Whether this module follows a container at `node`: its schema has only CONTAINER keywords."""
        return node is not None and not node.keys() - CONTAINER

    def child_of_object(self, node: dict | None, key: bytes) -> dict | None:
        if not self.follows(node):
            return None
        try:
            name = json.loads(b'"' + key + b'"')
        except ValueError:
            return None
        props = node.get("properties")
        if isinstance(props, dict) and name in props:
            return self.resolve(props[name])
        extra = node.get("additionalProperties", True)
        return self.resolve(extra) if extra is not False else None

    def child_of_array(self, node: dict | None, index: int) -> dict | None:
        if not self.follows(node):
            return None
        prefix = node.get("prefixItems")
        if isinstance(prefix, list) and index < len(prefix):
            return self.resolve(prefix[index])
        items = node.get("items", True)
        if isinstance(items, list):  # draft-4 tuple form
            return self.resolve(items[index]) if index < len(items) else None
        return self.resolve(items) if items is not False else None

    def is_free_string(self, node: dict | None) -> bool:
        return node is not None and _types(node) == ("string",) and not node.keys() - FREE_STRING

    def is_plain_number(self, node: dict | None) -> bool:
        return node is not None and _types(node) in (("integer",), ("number",)) and not node.keys() - PLAIN_NUMBER


class TextTrack:
    """The key of any byte-level grammar's state: the answer's text so far. keeps: whether masks of
    these keys are worth keeping across steps (texts rarely repeat: no)."""

    __slots__ = ("_text",)
    keeps = False

    def __init__(self) -> None:
        self._text = bytearray()

    def feed(self, data: bytes, leads: int | None = None) -> None:
        self._text += data

    def key(self) -> bytes:
        return bytes(self._text)


class _Frame:
    __slots__ = ("array", "expect", "index", "key", "node")

    def __init__(self, array: bool, node: dict | None) -> None:
        self.array = array
        self.node = node
        self.expect = VALUE_OR_CLOSE if array else KEY_OR_CLOSE
        self.index = 0
        self.key = b""


class KeyTrack:
    """One answer's position in its JSON (module docstring). keeps: masks of its keys are worth
    keeping across steps."""

    keeps = True

    __slots__ = (
        "_chars",
        "_esc",
        "_escaped",
        "_frames",
        "_free",
        "_lex",
        "_lost",
        "_node_at_lexeme",
        "_pending",
        "_prefix",
        "_root_done",
        "_s",
        "_skel",
        "_text",
    )

    def __init__(self, schema: SchemaKeys) -> None:
        self._s = schema
        self._skel = bytearray()  # the key's text so far, without the lexeme in progress
        self._frames: list[_Frame] = []
        self._root_done = False
        self._lex: str | None = None  # None | "key" | "str" | "num" | "lit"
        self._text = bytearray()  # the lexeme in progress, as written
        self._free = False  # the string in progress is at a free-string position
        self._escaped = False  # ... and has had an escape
        self._esc = False  # the last byte was a backslash inside a string
        self._prefix = b""  # bytes(skel) at the free string's opening quote
        self._chars = 0  # lead bytes (code points begun) in the free string
        self._pending = b""  # an unfinished UTF-8 character at the end of the free string
        self._lost = False
        self._node_at_lexeme: dict | None = None  # the schema position of the number in progress

    def key(self) -> Any:
        if self._lost:
            return None
        if self._lex == "str" and self._free and not self._escaped:
            pending = self._pending
            return (self._prefix, self._chars - (1 if pending else 0), pending)
        return bytes(self._skel) + self._text if self._lex else bytes(self._skel)

    def feed(self, data: bytes, leads: int | None = None) -> None:
        """The bytes of one accepted token. leads: plain_leads(data), precomputed per token."""
        if self._lost or not data:
            return
        if self._lex == "str" and self._free and not self._escaped and not self._esc:
            if leads is None:
                leads = plain_leads(data)
            if leads >= 0:  # the common case: characters inside a free string
                self._text += data
                self._chars += leads
                self._pending = _pending_utf8(self._text) if data[-1] >= 0x80 else b""
                return
        for b in data:
            self._byte(b)
            if self._lost:
                return
        if self._lex == "str" and self._free:
            self._pending = _pending_utf8(self._text)

    # --- the byte machine ----------------------------------------------------------------------

    def _node_here(self) -> dict | None:
        """The schema of the value about to start."""
        if not self._frames:
            return self._s.resolve(self._s.root)
        f = self._frames[-1]
        return self._s.child_of_array(f.node, f.index) if f.array else self._s.child_of_object(f.node, f.key)

    def _elides_values(self) -> bool:
        """Whether a complete scalar value here may be elided: it is a property or item of a
        container whose schema this module follows (module docstring). A frame's node is None when
        an enclosing container is not followed, so the innermost frame decides."""
        return bool(self._frames) and self._s.follows(self._frames[-1].node)

    def _expect(self) -> int:
        return self._frames[-1].expect if self._frames else (DONE if self._root_done else VALUE)

    def _value_done(self) -> None:
        if self._frames:
            self._frames[-1].expect = COMMA_OR_CLOSE
        else:
            self._root_done = True

    def _byte(self, b: int) -> None:
        lex = self._lex
        if lex in ("key", "str"):
            self._string_byte(b)
            return
        if lex == "num":
            if b in NUMBER_BYTES:
                self._text.append(b)
                return
            plain = self._s.is_plain_number(self._node_at_lexeme) or self._elides_values()
            self._skel += b"0" if plain else self._text
            self._end_lexeme()
            self._value_done()
        elif lex == "lit":
            self._text.append(b)
            word = bytes(self._text)
            if word in LITERALS:
                self._skel += b"0" if self._elides_values() else word
                self._end_lexeme()
                self._value_done()
            elif not any(w.startswith(word) for w in LITERALS):
                self._lost = True
            return
        self._structural(b)

    def _structural(self, b: int) -> None:
        if b in WHITESPACE:
            self._skel.append(b)
            return
        expect = self._expect()
        frame = self._frames[-1] if self._frames else None
        if expect in (VALUE, VALUE_OR_CLOSE):
            if b == ord("]") and expect == VALUE_OR_CLOSE:
                self._close()
            else:
                self._start_value(b)
        elif expect in (KEY_OR_CLOSE, KEY):
            if b == ord('"'):
                self._skel.append(b)
                self._lex, self._esc = "key", False
            elif b == ord("}") and expect == KEY_OR_CLOSE:
                self._close()
            else:
                self._lost = True
        elif expect == COLON and b == ord(":"):
            self._skel.append(b)
            frame.expect = VALUE
        elif expect == COMMA_OR_CLOSE and frame is not None:
            if b == ord(","):
                self._skel.append(b)
                if frame.array:
                    frame.index += 1
                    frame.expect = VALUE
                else:
                    frame.expect = KEY
            elif b == (ord("]") if frame.array else ord("}")):
                self._close()
            else:
                self._lost = True
        else:
            self._lost = True

    def _start_value(self, b: int) -> None:
        node = self._node_here()
        if b in (ord("{"), ord("[")):
            self._skel.append(b)
            self._frames.append(_Frame(b == ord("["), node))
        elif b == ord('"'):
            self._skel.append(b)
            self._lex, self._esc, self._escaped = "str", False, False
            self._free = self._s.is_free_string(node)
            if self._free:
                self._prefix, self._chars = bytes(self._skel), 0
        elif b in NUMBER_BYTES:
            self._lex = "num"
            self._node_at_lexeme = node
            self._text.append(b)
        elif b in b"tfn":
            self._lex = "lit"
            self._text.append(b)
        else:
            self._lost = True

    def _close(self) -> None:
        frame = self._frames.pop()
        self._skel.append(ord("]") if frame.array else ord("}"))
        self._value_done()

    def _string_byte(self, b: int) -> None:
        if self._esc:
            self._esc = False
            self._text.append(b)
            return
        if b == ord("\\"):
            self._esc = True
            self._escaped = True
            self._text.append(b)
            return
        if b != ord('"'):
            self._text.append(b)
            if b & 0xC0 != 0x80:
                self._chars += 1
            return
        if self._lex == "key":
            self._frames[-1].key = bytes(self._text)
            self._skel += self._text
            self._skel.append(b)
            self._frames[-1].expect = COLON
            self._end_lexeme()
            return
        if not self._free and not self._elides_values():
            self._skel += self._text
        self._skel.append(b)
        self._end_lexeme()
        self._value_done()

    def _end_lexeme(self) -> None:
        self._lex = None
        self._text = bytearray()
        self._free = self._escaped = self._esc = False


def plain_leads(data: bytes) -> int:
    """How many characters `data` begins (UTF-8 lead bytes) when it has no quote, backslash or
    control byte (then it stays inside a string as its characters); -1 otherwise."""
    if not data or b'"' in data or b"\\" in data or min(data) < 0x20:
        return -1
    return sum(1 for b in data if b & 0xC0 != 0x80)


def vocab_plain_leads(token_bytes: list[bytes]) -> list[int]:
    """plain_leads of every token at once (a vocabulary's table, built in milliseconds: one pass of
    numpy over all the bytes instead of a Python call per token)."""
    import numpy as np

    lens = np.fromiter(map(len, token_bytes), dtype=np.int64, count=len(token_bytes))
    flat = np.frombuffer(b"".join(token_bytes), dtype=np.uint8)
    ends = np.cumsum(lens)
    starts = ends - lens

    def per_token(flags: np.ndarray) -> np.ndarray:
        total = np.concatenate(([0], np.cumsum(flags, dtype=np.int64)))
        return total[ends] - total[starts]

    bad = per_token((flat == 0x22) | (flat == 0x5C) | (flat < 0x20))
    leads = per_token((flat & 0xC0) != 0x80)
    return np.where((lens == 0) | (bad > 0), -1, leads).tolist()


def _pending_utf8(text: bytearray) -> bytes:
    """The bytes of an unfinished UTF-8 character at the end of text (b"" if none)."""
    n = len(text)
    for back in range(1, min(4, n) + 1):
        b = text[n - back]
        if b & 0xC0 == 0x80:
            continue
        need = 1 if b < 0x80 else 2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 else 4
        return bytes(text[n - back:]) if back < need else b""
    return b""
