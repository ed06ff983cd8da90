"""tokenizer.*: which tokenizer file a run reads and the model.vocab_size it implies, settled at compose time.

tokenizer=o200k reads no file and leaves model.vocab_size alone (200,019 by default; data=random runs set
their own). tokenizer=bpe reads its tokenizer.json — tokenizer.path, or, when that is null and data=tokens,
the one `python -m trmoe.data.prepare --tokenizer bpe` wrote beside the shards of data.path — and fills in
what the run records (run_config.json, every checkpoint's meta.json): tokenizer.path (absolute),
tokenizer.sha256 (training-critical: a resume with another file is refused) and model.vocab_size = the
tokenizer's vocabulary (the tied embedding and the route tables are built over it; any other explicit value
is refused, the o200k default is replaced).

A recorded config read back (trmoe.load: sample, export, eval) has all three set: when its file is gone it
still composes (the model needs only the recorded vocabulary); whoever needs the tokenizer itself then says
in one line that the file is missing.
"""

from __future__ import annotations

from pathlib import Path

from trmoe.config.schema import Config, TokenizerName
from trmoe.data.tokenizer import O200K_VOCAB
from trmoe.errors import UserError


def _fail(key: str, value: object, allowed: str) -> None:
    raise UserError(f"config error: {key}={value}: {allowed}")


def tokenizer_file(cfg: Config) -> Path | None:
    """The tokenizer.json tokenizer=bpe reads: tokenizer.path, else the one beside data=tokens shards."""
    t, d = cfg.tokenizer, cfg.data
    if t.path:
        return Path(t.path).expanduser().resolve()
    if getattr(d.source, "value", d.source) == "tokens" and getattr(d, "path", None):
        from trmoe.data.sources.tokens import shard_tokenizer_file

        return shard_tokenizer_file(d.path)
    return None


def resolve_tokenizer(cfg: Config) -> dict[str, object] | None:
    """Check tokenizer.* and fill in tokenizer=bpe's path, sha256 and model.vocab_size (in `cfg` and in the
    returned {dotted key: value}, for the caller to write back into the composed config); None for o200k."""
    t = cfg.tokenizer
    if t.name is TokenizerName.o200k:
        if t.path is not None:
            _fail("tokenizer.path", t.path, "tokenizer=o200k reads no file; allowed: null, or tokenizer=bpe")
        if t.sha256 is not None:
            _fail("tokenizer.sha256", t.sha256, "tokenizer=o200k has no file to pin; allowed: null")
        return None
    path = tokenizer_file(cfg)
    if path is None:
        where = f" (none beside data.path={cfg.data.path})" if cfg.data.source.value == "tokens" else ""
        _fail(
            "tokenizer.path",
            "null",
            f"tokenizer=bpe needs its tokenizer.json{where}; allowed: tokenizer.path=<file> written by "
            "`python -m trmoe.data.prepare --tokenizer bpe --vocab-size N`, or data=tokens with data.path "
            "at a dataset prepared that way",
        )
    if not path.exists() and t.sha256 is not None and t.path is not None:
        return None  # a recorded config read back: its vocabulary is recorded (module docstring)
    if not path.is_file():
        _fail("tokenizer.path", path, "no such file; allowed: a tokenizer.json of `prepare --tokenizer bpe`")
    from trmoe.data.bpe import load_bpe

    tok = load_bpe(path)
    if t.sha256 is not None and t.sha256 != tok.sha256:
        _fail(
            "tokenizer.sha256",
            t.sha256,
            f"{path} has sha256 {tok.sha256} (the file changed, or another one); allowed: the pinned file",
        )
    m = cfg.model
    if m.vocab_size not in (O200K_VOCAB, tok.n_vocab):
        _fail(
            "model.vocab_size",
            m.vocab_size,
            f"tokenizer=bpe sets it to the tokenizer's {tok.n_vocab} ids ({path}); allowed: leave it unset",
        )
    t.path, t.sha256, m.vocab_size = str(path), tok.sha256, tok.n_vocab
    return {"tokenizer.path": t.path, "tokenizer.sha256": t.sha256, "model.vocab_size": m.vocab_size}
