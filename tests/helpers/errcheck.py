"""The error check the input-contract tests share: an error class and the words its message must hold."""

import pytest

from hexiseq import HexiseqError


def raises_with(exc, fn, *needles):
    """fn() raises `exc` (a HexiseqError subclass) or a subclass of it, with every needle in its message; returns
    the message for further checks."""
    assert issubclass(exc, HexiseqError)
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    for needle in needles:
        assert str(needle) in msg, (needle, msg)
    return msg


def same_error_on_every_rank(reports, name, cls, words, within_s=4.0):
    """Every rank's report of scenario `name` (reports: {rank: {scenario: (class name, message, seconds)}}) is the
    same error: class `cls`, a message holding every one of `words`, raised within `within_s` seconds (under the
    scenarios' group timeout: nobody waited for it), and one message on every rank."""
    for rank, report in sorted(reports.items()):
        kind, message, seconds = report[name]
        assert kind == cls, f"{name}: rank {rank} raised {kind}: {message}"
        for w in words:
            assert w in message, f"{name}: rank {rank}'s message lacks {w!r}: {message}"
        assert seconds < within_s, f"{name}: rank {rank} took {seconds:.1f} s (the group timeout is 5 s: it waited)"
    assert len({report[name][1] for report in reports.values()}) == 1, f"{name}: messages differ between ranks"
