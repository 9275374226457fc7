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
