"""A free TCP port on the loopback interface, for the tests that start a process group."""

import socket


def free_port() -> int:
    """A port nothing listens on now (the OS picks it; closed again before it is returned)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
