"""A Hugging Face hub stand-in that never answers: it accepts each connection and closes it at
once, and counts them. A check that makes one look-up instead of the loaders' minute of
retries is then a count (at most a couple of connections), not a wall-clock figure."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class SilentHub:
    url: str
    connections: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


@contextmanager
def silent_hub() -> Iterator[SilentHub]:
    """``with silent_hub() as hub:`` point HF_ENDPOINT (or huggingface_hub's constants.ENDPOINT)
    at ``hub.url``; ``hub.connections`` counts the look-ups that reached it."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    hub = SilentHub(f"http://127.0.0.1:{server.getsockname()[1]}")

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return  # closed: the test is over
            with hub._lock:
                hub.connections += 1
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.close()
