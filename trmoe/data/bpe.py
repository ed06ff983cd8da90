"""Small byte-level BPE tokenizers (`tokenizer=bpe`), trained with Hugging Face `tokenizers` on a corpus.

Why: with o200k's 200,019 ids the tied head dominates a small model's compute (at ladder_smoke's rungs it is
1.92e7 of 1.925e7 FLOPs per token), so a model small enough for one machine learns mostly its embedding. A
BPE of N = 512 ... 32,768 ids trained on the corpus itself keeps the head a fraction of the compute.

The tokenizer (one `tokenizer.json`, the format `tokenizers` and transformers' PreTrainedTokenizerFast read):
    id 0                  <|endoftext|>  (the end-of-document token, EOS)
    ids 1 ... 256         the 256 bytes, each as the printable character GPT-2's byte-to-unicode map gives it,
                          so every string encodes (no unknown token) and every id is a whole number of bytes
    ids 257 ... N - 1     merges, in the order the trainer learned them (most frequent adjacent pair first)
Pre-tokenization: the byte-level GPT-2 split (words, numbers, punctuation runs, spaces kept in front of the
next word); merges never cross a split.

Vocabulary rule (`--vocab-size N`): N >= MIN_VOCAB (257: the bytes and EOS), and N <= 257 + the number of
merges the corpus supports: a merge is learned only for a pair that occurs at least MIN_PAIR_COUNT (2) times,
so a small corpus runs out of pairs before a large N. The trainer's actual result size is compared with N; a
shortfall is refused (naming the most the corpus gives), never padded with unused ids.

Deterministic: the same documents in the same order and the same N give a byte-identical tokenizer.json (the
trainer breaks ties in pair counts by the pairs' ids; its serialisation orders the vocabulary by id), so its
sha256 identifies it in shard indexes and run records.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from trmoe.errors import UserError

NAME = "bpe"  # the shard index's `tokenizer` field, and tokenizer.name
EOS_TOKEN = "<|endoftext|>"
MIN_VOCAB = 257  # the 256 bytes and EOS
MIN_PAIR_COUNT = 2  # a pair seen once is no pattern: no merge for it
FILE_NAME = "tokenizer.json"  # beside a prepared dataset's train/ and eval/


@functools.cache
def byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable bytes stand for themselves, the others (controls,
    space, 127-160, 173) for the characters 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def check_vocab_size(vocab_size: int, option: str = "--vocab-size") -> None:
    if vocab_size < MIN_VOCAB:
        raise UserError(
            f"{option} {vocab_size}: a byte-level BPE needs at least {MIN_VOCAB} ids (256 bytes and "
            f"{EOS_TOKEN}); allowed: {MIN_VOCAB} or more, up to what the corpus supports"
        )


def train_bpe(texts: Iterable[str], vocab_size: int, *, length: int | None = None) -> str:
    """tokenizer.json text of a byte-level BPE of exactly `vocab_size` ids trained on `texts` (module
    docstring); a UserError when the corpus supports fewer merges than that."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    check_vocab_size(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=MIN_PAIR_COUNT,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer, length=length)
    got = tok.get_vocab_size(with_added_tokens=True)
    if got < vocab_size:
        raise UserError(
            f"--vocab-size {vocab_size}: this corpus supports at most {got} ids ({MIN_VOCAB} + the "
            f"{got - MIN_VOCAB} merges of pairs that occur at least {MIN_PAIR_COUNT} times); allowed: "
            f"{MIN_VOCAB}..{got}, or a larger corpus"
        )
    return tok.to_str(pretty=False) + "\n"


class BPETokenizer:
    """A tokenizer.json of `train_bpe`, with the methods trmoe uses of a tokenizer (trmoe.data.tokenizer's
    Tokenizer): `encode_ordinary` reads "<|endoftext|>" in a text as text (as tiktoken's does), `encode`
    (prompts) as EOS."""

    name = NAME

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        self.path = Path(path).expanduser().resolve()
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            raise UserError(f"tokenizer file {self.path}: no such file") from None
        except OSError as exc:
            raise UserError(f"tokenizer file {self.path}: cannot read ({exc.strerror or exc})") from None
        self.sha256 = hashlib.sha256(raw).hexdigest()
        try:
            self._special = Tokenizer.from_str(raw.decode("utf-8"))
            self._plain = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as exc:  # tokenizers raises its own Exception type for a malformed file
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise UserError(f"tokenizer file {self.path}: not a tokenizer.json ({detail[:120]})") from None
        self._plain.encode_special_tokens = True
        eos = self._special.token_to_id(EOS_TOKEN)
        if eos is None or json.loads(raw).get("model", {}).get("type") != "BPE":
            raise UserError(
                f"tokenizer file {self.path}: not a byte-level BPE with {EOS_TOKEN}; allowed: a "
                "tokenizer.json written by `python -m trmoe.data.prepare --tokenizer bpe`"
            )
        self.eos_id = int(eos)
        self.eot_token = self.eos_id
        self.n_vocab = int(self._special.get_vocab_size(with_added_tokens=True))

    def encode_ordinary(self, text: str) -> list[int]:
        return self._plain.encode(text, add_special_tokens=False).ids

    def encode_ordinary_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._plain.encode_batch(texts, add_special_tokens=False)]

    def encode(self, text: str, allowed_special: str = "all") -> list[int]:
        return self._special.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._special.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self, token: int) -> bytes:
        """The bytes id `token` stands for; b"" for EOS (not text)."""
        if token == self.eos_id:
            return b""
        table = byte_of_char()
        return bytes(table[c] for c in self._special.id_to_token(token))

    def byte_lengths(self) -> np.ndarray:
        """UTF-8 bytes of each id (0 for EOS): what turns a loss into bits per byte."""
        return np.array([len(self.token_bytes(t)) for t in range(self.n_vocab)], dtype=np.int64)


@functools.lru_cache(maxsize=4)
def _load(path: str, mtime_ns: int, size: int) -> BPETokenizer:
    return BPETokenizer(path)


def load_bpe(path: str | Path) -> BPETokenizer:
    """The BPE tokenizer at `path`, cached per file version (a file rewritten in place is read again)."""
    resolved = Path(path).expanduser().resolve()
    try:
        st = resolved.stat()
    except FileNotFoundError:
        raise UserError(f"tokenizer file {resolved}: no such file") from None
    except OSError as exc:
        raise UserError(f"tokenizer file {resolved}: cannot read ({exc.strerror or exc})") from None
    if not resolved.is_file():
        raise UserError(f"tokenizer file {resolved}: not a regular file")
    return _load(str(resolved), st.st_mtime_ns, st.st_size)
