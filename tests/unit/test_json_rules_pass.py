"""checked_json.parse checks the JSON rules on a large text on a thread while json decodes it: every
verdict must be the one the in-line check gives (same value, or the same error), both ways round."""
from __future__ import annotations

import pytest

from recckpt.errors import CorruptCheckpointError
from recckpt.format import checked_json
from recckpt.format.checked_json import MAX_DEPTH, JsonLimits, parse

PAD = "x" * (checked_json._RulesPass.THREAD_FROM + 10)


def _texts():
    deep = "[" * (MAX_DEPTH + 3) + "]" * (MAX_DEPTH + 3)
    return {
        "valid": ('{"pad": "%s", "a": [[1, 2], {"b": "c"}]}' % PAD, None),
        "too deep": ('{"pad": "%s", "a": %s}' % (PAD, deep), "nested more than"),
        "lone surrogate": ('{"pad": "%s", "a": "\\ud800"}' % PAD, "lone surrogate"),
        "long number": ('{"pad": "%s", "a": %s}' % (PAD, "9" * (checked_json.MAX_NUMBER_CHARS + 1)), "digits"),
        "duplicate key": ('{"pad": "%s", "a": 1, "a": 2}' % PAD, "appears twice"),
        "not json": ('{"pad": "%s", "a": }' % PAD, "JSONDecodeError"),
        # a key twice beside another problem: the key is named first on both paths (found by a review)
        "twice, then NaN": ('["%s", {"a": 1, "a": 2}, NaN]' % PAD, "appears twice"),
        "twice, then extra data": ('{"pad": "%s", "a": 1, "a": 2} x' % PAD, "appears twice"),
        "twice and a long number": ('{"pad": "%s", "a": 1, "a": %s}' % (PAD, "9" * (checked_json.MAX_NUMBER_CHARS + 1)),
                                    "appears twice"),
    }


def _verdict(text, as_bytes):
    try:
        return "ok", parse(text.encode() if as_bytes else text, "f.json", JsonLimits(1 << 30))
    except CorruptCheckpointError as e:
        return "error", str(e)


@pytest.mark.parametrize("as_bytes", [False, True])
@pytest.mark.parametrize("name", list(_texts()))
def test_the_threaded_rules_pass_gives_the_in_line_verdict(monkeypatch, name, as_bytes):
    text, expect = _texts()[name]
    assert len(text) >= checked_json._RulesPass.THREAD_FROM   # the thread's path
    threaded = _verdict(text, as_bytes)
    monkeypatch.setattr(checked_json._RulesPass, "THREAD_FROM", 1 << 62)
    in_line = _verdict(text, as_bytes)
    assert threaded == in_line
    if expect is None:
        assert threaded[0] == "ok" and threaded[1]["a"] == [[1, 2], {"b": "c"}]
    else:
        assert threaded[0] == "error" and expect in threaded[1], threaded[1][-200:]
