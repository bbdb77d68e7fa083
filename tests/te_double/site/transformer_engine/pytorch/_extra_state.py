"""TEST DOUBLE of ``transformer_engine.pytorch._extra_state`` (added in TE 2.18).

TE >= 2.18 refuses to unpickle ``_extra_state`` that holds FP8 delayed-scaling state (a pickle
can run code) unless ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1``; empty and stateless payloads
are ignored. The double applies that policy when it emulates such a release (``TE_DOUBLE_VERSION``,
default the pinned one) and unpickles everything when it emulates an older one, as TE 2.16 does.
The variable's name and the advisory's wording are checked against the pinned wheel's source
(tests/integration/test_te_contract.py).
"""

from __future__ import annotations

import os
import pickletools

UNSAFE_PICKLE_EXTRA_STATE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"
#: The first release with the refusal.
REFUSING_SINCE = (2, 18)
_DELAYED_SCALING_KEYS = {"scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"}


def emulated_version() -> tuple[int, ...]:
    from transformer_engine import __version__

    return tuple(int(p) for p in __version__.split("+")[0].split(".")[:2])


def unsafe_pickle_extra_state_enabled() -> bool:
    return os.getenv(UNSAFE_PICKLE_EXTRA_STATE_ENV, "0") == "1"


def extra_state_pickle_advisory(context: str) -> str:
    return (
        f"Refusing to load pickled Transformer Engine extra state for {context}. "
        "Delayed-scaling FP8 metadata can be stored as a Python pickle, and loading it "
        "can execute arbitrary code. Only enable unsafe loading if this checkpoint is from "
        f"a trusted source. To load it anyway, set {UNSAFE_PICKLE_EXTRA_STATE_ENV}=1."
    )


def _holds_delayed_scaling_state(data: bytes) -> bool:
    """Read the pickle's opcodes without running it: delayed-scaling keys or recipe class."""
    for _opcode, arg, _pos in pickletools.genops(data):
        if isinstance(arg, str) and (arg in _DELAYED_SCALING_KEYS or "DelayedScaling" in arg):
            return True
    return False


def should_load_extra_state_pickle(data: bytes, context: str) -> bool:
    """False: nothing to load; True: unpickle; raises TE's advisory for refused payloads."""
    if emulated_version() < REFUSING_SINCE:
        return True
    if not _holds_delayed_scaling_state(data):
        return False
    if unsafe_pickle_extra_state_enabled():
        return True
    raise RuntimeError(extra_state_pickle_advisory(context))
