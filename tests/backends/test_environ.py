"""`tedebug.backends.environ.environ_value`: ``decode(raw())`` is ``os.environ.get``'s value at every call, through
any change, and ``raw()`` is the same object exactly while the variable is not set again."""

import os

from tedebug.backends.environ import environ_value


def _read(env):
    raw = env.raw()
    return None if raw is None else env.decode(raw)


def test_value_follows_every_change(monkeypatch):
    name = "TEDEBUG_TEST_ENVIRON_VALUE"
    monkeypatch.delenv(name, raising=False)
    env = environ_value(name)
    assert env.raw() is None
    monkeypatch.setenv(name, "cupy")
    first = env.raw()
    assert env.raw() is first and _read(env) == "cupy"  # unchanged: the same object
    os.environ[name] = "cupy"  # set again, to the same text: another object, the same value
    assert env.raw() is not first and _read(env) == "cupy"
    os.environ[name] = "torch"
    assert _read(env) == "torch"
    os.environ[name] = "tørch ü"  # non-ASCII: decoded as os.environ decodes it
    assert _read(env) == os.environ.get(name) == "tørch ü"
    os.environ[name] = ""
    assert _read(env) == ""
    del os.environ[name]
    assert env.raw() is None
    monkeypatch.setenv(name, "auto")
    assert _read(env) == "auto"


def test_value_without_the_encoded_mapping_falls_back_to_get(monkeypatch):
    name = "TEDEBUG_TEST_ENVIRON_FALLBACK"

    class Plain(dict):
        pass

    plain = Plain({name: "x"})
    monkeypatch.setattr(os, "environ", plain)
    env = environ_value(name)
    assert _read(env) == "x"
    plain[name] = "y"
    assert _read(env) == "y"
    del plain[name]
    assert env.raw() is None


def test_text_is_the_value_or_empty_when_unset(monkeypatch):
    name = "TEDEBUG_TEST_ENVIRON_TEXT"
    monkeypatch.delenv(name, raising=False)
    env = environ_value(name)
    assert env.text(env.raw()) == ""
    monkeypatch.setenv(name, " Cupy ")
    assert env.text(env.raw()) == " Cupy "  # as set: the callers strip and lower it themselves
    monkeypatch.setenv(name, "")
    assert env.text(env.raw()) == ""
