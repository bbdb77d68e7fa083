"""A server that never answers (a Hugging Face hub, an MLflow tracking server): it accepts each
connection and closes it at once, or holds it open until the test lets go, and counts them. A
check that makes one look-up instead of the loaders' minute of retries is then a count (at most
a couple of connections), not a wall-clock figure; a run that goes on while its tracker's
server holds it is an order of log lines."""

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
    _released: threading.Event = field(default_factory=threading.Event, repr=False)

    def release(self) -> None:
        """A holding server closes the connections it holds, and later ones at once."""
        self._released.set()


@contextmanager
def silent_hub(*, hold: bool = False, hold_at_most_s: float = 300) -> Iterator[SilentHub]:
    """``with silent_hub() as hub:`` point HF_ENDPOINT (or huggingface_hub's constants.ENDPOINT,
    or MLFLOW_TRACKING_URI) at ``hub.url``; ``hub.connections`` counts the look-ups that
    reached it. ``hold``: connections stay open, unanswered, until ``hub.release()`` (or
    ``hold_at_most_s``, so a test that waits on them fails instead of hanging)."""
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
            if hold:
                threading.Thread(target=close_on_release, args=(conn,), daemon=True).start()
            else:
                conn.close()

    def close_on_release(conn: socket.socket) -> None:
        hub._released.wait(hold_at_most_s)
        conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        hub.release()
        server.close()
