"""`tedebug.backends.environ.environ_reader`: the value of ``os.environ.get`` at every call, through any change."""

import os

from tedebug.backends.environ import environ_reader


def test_reader_follows_every_change(monkeypatch):
    name = "TEDEBUG_TEST_ENVIRON_READER"
    monkeypatch.delenv(name, raising=False)
    read = environ_reader(name)
    assert read() is None
    monkeypatch.setenv(name, "cupy")
    assert read() == "cupy"
    os.environ[name] = "torch"
    assert read() == "torch"
    os.environ[name] = "tørch ü"  # non-ASCII: decoded as os.environ decodes it
    assert read() == os.environ.get(name) == "tørch ü"
    os.environ[name] = ""
    assert read() == ""
    del os.environ[name]
    assert read() is None
    monkeypatch.setenv(name, "auto")
    assert read() == "auto"


def test_reader_without_the_encoded_mapping_falls_back_to_get(monkeypatch):
    name = "TEDEBUG_TEST_ENVIRON_FALLBACK"

    class Plain(dict):
        pass

    plain = Plain({name: "x"})
    monkeypatch.setattr(os, "environ", plain)
    read = environ_reader(name)
    assert read() == "x"
    plain[name] = "y"
    assert read() == "y"
