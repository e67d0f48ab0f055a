"""Servers of the tests started on free localhost ports, again on new ports when one was taken
(:func:`start_on_free_ports`, from :mod:`kvtier.tools.ports`, where the benchmarks that start
their own servers find it too); each try in a folder of its own (:func:`folder_of_try`).

A test that needs a port where nothing listens takes :func:`closed_port` (or the fixture
:func:`dead_port`): held by the test, so
nothing else can start listening there while it runs (a port merely probed free could be anyone's
a moment later).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvtier.tools.ports import TRIES, PortTaken, listening, port_taken_in, start_on_free_ports

__all__ = ["TRIES", "PortTaken", "closed_port", "dead_port", "folder_of_try", "listening", "port_taken_in", "start_on_free_ports"]


def folder_of_try(folder: Path, n: int) -> Path:
    """The folder of try ``n`` of a server kept in ``folder``: the first try's is ``folder``,
    each later one a fresh sibling, so no try reads the log of the one before it."""
    return folder if n == 0 else folder.with_name(f"{folder.name}-try{n}")


@contextmanager
def closed_port() -> Iterator[int]:
    """A localhost port where nothing listens for as long as the ``with`` block runs: a socket of
    the test's binds it without listening, so a connection is refused and no server can bind it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        yield int(held.getsockname()[1])


@pytest.fixture
def dead_port() -> Iterator[int]:
    """A :func:`closed_port` for the whole test."""
    with closed_port() as port:
        yield port
