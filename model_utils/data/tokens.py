"""Tokenizer loading and the pipeline's one tokenisation call: documents -> ids + EOS."""

from __future__ import annotations

import hashlib
import json
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from model_utils.data.checks import check_hub_repo
from model_utils.data.sources import looks_like_path
from model_utils.errors import UsageError, first_words

if TYPE_CHECKING:  # imported lazily at run time: transformers is slow to import
    from transformers import PreTrainedTokenizerBase

TOKENIZE_BATCH = 64  # documents per tokenizer call (also the re-tokenisation cost of a resume)

#: Files one of which a saved Hugging Face tokenizer folder holds (fast, config, or slow
#: SentencePiece / BPE vocabularies).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """Load a Hugging Face tokenizer (hub name or local directory); it must define an EOS token."""
    from transformers import AutoTokenizer

    path = Path(name_or_path).expanduser()
    if not path.exists() and looks_like_path(name_or_path):
        raise UsageError(f"--tokenizer {name_or_path}: no such directory")
    if path.is_file():  # transformers took a file for a malformed hub name
        raise UsageError(
            f"--tokenizer {name_or_path} is a file: give the folder that holds it "
            f"({path.parent}), with tokenizer.json or tokenizer_config.json"
        )
    if path.is_dir() and not any((path / n).is_file() for n in TOKENIZER_FILES):
        raise UsageError(
            f"--tokenizer {name_or_path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})"
            ": give the folder a tokenizer was saved to (save_pretrained), or a hub name"
        )
    tokenizer = None if path.exists() else _cached(name_or_path)
    if tokenizer is None and not path.exists():
        # One quick look-up of the name, the same as --dataset's name gets, where the loader
        # would retry each file for about a minute and print some 45 lines before its error.
        check_hub_repo(
            name_or_path,
            "model",
            f"--tokenizer {name_or_path}: no local folder of that name, not in the Hugging Face "
            "cache",
            "give the local folder a tokenizer was saved to (save_pretrained)",
        )
    try:
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(
                str(path) if path.exists() else name_or_path, trust_remote_code=False
            )
    except (OSError, ValueError) as error:
        reason = first_words(error)
        raise UsageError(f"--tokenizer {name_or_path}: cannot be loaded ({reason})") from error
    if tokenizer.eos_token_id is None:
        raise UsageError(
            f"--tokenizer {name_or_path} has no EOS token, which is needed between documents: "
            "set eos_token in its tokenizer_config.json (or special_tokens_map.json)"
        )
    return tokenizer


def _cached(name: str) -> PreTrainedTokenizerBase | None:
    """The hub tokenizer `name` from the local Hugging Face cache (no network), or None."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError):
        return None


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A short sha256 of what the tokenizer does (vocabulary, merges, normalisation, added
    tokens), not of where it lives: a hub tokenizer updated upstream, or a folder retrained in
    place, keeps its name but would turn a resumed run's data into other token ids."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        text = backend.to_str()
    else:  # a slow tokenizer: its vocabulary is what it does
        text = json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_vocab(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
    """Fail early, in one line, when token ids would overflow the model's embedding table."""
    needed = len(tokenizer)
    if needed > vocab_size:
        raise UsageError(
            f"tokenizer {tokenizer.name_or_path} has {needed} tokens but the model's vocab_size is "
            f"{vocab_size}: pass --vocab_size {needed} (or more), or use a tokenizer with at most "
            f"{vocab_size} tokens"
        )


def encode_documents(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> np.ndarray:
    """Token ids of each text followed by EOS, concatenated (int64).

    One batched call into the Rust tokenizer, with no truncation and no special tokens other than
    the EOS separator; this is the only place the pipeline tokenises.
    """
    eos = tokenizer.eos_token_id
    if not texts:
        return np.empty(0, dtype=np.int64)
    if tokenizer.is_fast:
        encodings = _backend(tokenizer).encode_batch_fast(texts, add_special_tokens=False)
        documents = [encoding.ids for encoding in encodings]
    else:  # slow (Python) tokenizers still work, just slower
        encoded = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)
        documents = encoded["input_ids"]
    separator = np.array([eos], dtype=np.int64)
    pieces = []
    for ids in documents:  # one C-level list->array copy per document, then one concatenation
        pieces += [np.array(ids, dtype=np.int64), separator]
    return np.concatenate(pieces)


_BACKENDS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _backend(tokenizer: PreTrainedTokenizerBase) -> Any:
    """A private copy of the Rust tokenizer with truncation and padding off, one per tokenizer.

    A copy, because transformers changes the backend's truncation/padding settings per call and
    a hub tokenizer.json may ship with truncation enabled, which would silently cut documents.
    """
    backend = _BACKENDS.get(tokenizer)
    if backend is None:
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        backend.no_truncation()
        backend.no_padding()
        _BACKENDS[tokenizer] = backend
    return backend
