"""The built-in character-level corpus: Python's own standard library sources, no download ever.

Every CPython installation that can run mixprec carries its standard library's ``.py`` files, so the default
corpus is a fixed, sorted list of them (:data:`STDLIB_FILES`), read from ``sysconfig``'s stdlib directory and
concatenated in that order. The list holds modules that exist as plain files in CPython 3.11 to 3.14 (no frozen
modules, none that became packages or shims). Their contents change between Python releases, so the corpus is
deterministic per Python version; :attr:`Corpus.sha256` identifies it, and every run records it.

Tokens are characters: the vocabulary is the sorted set of Unicode code points in the text, and a token id is a
code point's rank in it. The split is deterministic and interleaved: the text is cut into chunks of
:data:`SPLIT_CHUNK` characters and every tenth chunk (index 9, 19, ...) goes to validation, so both splits
sample every file instead of validation being the last file alone.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["STDLIB_FILES", "SPLIT_CHUNK", "Corpus", "CorpusError", "load_corpus"]

STDLIB_FILES: tuple[str, ...] = (
    "argparse.py",
    "ast.py",
    "calendar.py",
    "collections/__init__.py",
    "configparser.py",
    "contextlib.py",
    "csv.py",
    "dataclasses.py",
    "difflib.py",
    "enum.py",
    "fractions.py",
    "functools.py",
    "heapq.py",
    "inspect.py",
    "json/decoder.py",
    "json/encoder.py",
    "logging/__init__.py",
    "pprint.py",
    "queue.py",
    "random.py",
    "shlex.py",
    "statistics.py",
    "textwrap.py",
    "threading.py",
    "tokenize.py",
    "traceback.py",
    "typing.py",
)

SPLIT_CHUNK = 4096  # characters per split chunk; every 10th chunk is validation
_VAL_EVERY = 10
_MIN_CHARS = 10_000  # below this a split cannot hold even a few windows of a useful block size


class CorpusError(ValueError):
    """The corpus cannot be read (missing path, no stdlib sources, not UTF-8, too short)."""


@dataclass(frozen=True)
class Corpus:
    """A tokenised corpus with its deterministic split.

    Attributes:
        name: ``"stdlib"`` or the path given.
        sha256: hex digest of the UTF-8 text; equal digests mean equal corpora.
        files: the files read, in order.
        vocab: the sorted Unicode code points; token id i is ``chr(vocab[i])``.
        train: int64 token ids of the training split, 1-D.
        val: int64 token ids of the validation split, 1-D.
    """

    name: str
    sha256: str
    files: tuple[str, ...]
    vocab: tuple[int, ...]
    train: torch.Tensor
    val: torch.Tensor

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(chr(self.vocab[i]) for i in ids.tolist())


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def _read_stdlib() -> tuple[str, tuple[str, ...]]:
    root = stdlib_dir()
    present = [f for f in STDLIB_FILES if os.path.isfile(os.path.join(root, f))]
    if not present:
        raise CorpusError(
            f"corpus 'stdlib': none of the standard library source files were found under {root} "
            "(some minimal Python installs ship only .pyc files); pass corpus = PATH to a UTF-8 text file"
        )
    texts = []
    for f in present:
        with open(os.path.join(root, f), encoding="utf-8") as fh:
            texts.append(fh.read())
    return "\n".join(texts), tuple(present)


def _read_path(path: str) -> str:
    if not os.path.isfile(path):
        raise CorpusError(f"corpus: no such file: {path!r} (give a UTF-8 text file, or 'stdlib' for the built-in)")
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except UnicodeDecodeError as exc:
        raise CorpusError(f"corpus: {path!r} is not UTF-8 text ({exc})") from exc


def check_corpus_source(corpus: str) -> None:
    """Cheap existence check (no reading), so a launcher can refuse a bad path before starting ranks."""
    if corpus == "stdlib":
        if not any(os.path.isfile(os.path.join(stdlib_dir(), f)) for f in STDLIB_FILES):
            _read_stdlib()  # raises the full message
    elif not os.path.isfile(corpus):
        _read_path(corpus)


def load_corpus(corpus: str = "stdlib") -> Corpus:
    """Read, tokenise and split ``corpus`` (``"stdlib"`` or a path to a UTF-8 text file).

    Cached per process (keyed by the path, its size and modification time), so ranks forked after the launcher
    loaded it share it; the returned tensors must not be modified.

    Raises:
        CorpusError: missing file, no stdlib sources, undecodable text, or fewer than 10,000 characters.
    """
    key = None
    if corpus != "stdlib" and os.path.isfile(corpus):
        st = os.stat(corpus)
        key = (st.st_size, st.st_mtime_ns)
    return _load_cached(corpus, key)


@functools.lru_cache(maxsize=4)
def _load_cached(corpus: str, _file_key: tuple[int, int] | None) -> Corpus:
    if corpus == "stdlib":
        text, files = _read_stdlib()
    else:
        text, files = _read_path(corpus), (os.path.abspath(corpus),)
    if len(text) < _MIN_CHARS:
        raise CorpusError(f"corpus {corpus!r} holds {len(text)} characters; at least {_MIN_CHARS} are needed")
    sha = hashlib.sha256(text.encode("utf-8")).hexdigest()
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    vocab = np.unique(codes)
    ids = torch.from_numpy(np.searchsorted(vocab, codes).astype(np.int64))
    n_chunks = -(-ids.numel() // SPLIT_CHUNK)
    is_val = torch.arange(n_chunks) % _VAL_EVERY == _VAL_EVERY - 1
    if not bool(is_val.any()):  # a short corpus: its last chunk is the validation split
        is_val[-1] = True
    chunks = ids.split(SPLIT_CHUNK)
    train = torch.cat([c for c, v in zip(chunks, is_val.tolist()) if not v])
    val = torch.cat([c for c, v in zip(chunks, is_val.tolist()) if v])
    return Corpus(corpus, sha, files, tuple(int(v) for v in vocab), train, val)
