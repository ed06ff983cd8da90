"""data=tokens: memory-mapped token shards written by `python -m trmoe.data.prepare` (data.path)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trmoe.data.variant import DataSourceVariant, fail
from trmoe.errors import UserError

if TYPE_CHECKING:
    from trmoe.config.schema import Config
    from trmoe.data.pipeline import DataPipeline
    from trmoe.data.shards import TokenShard
    from trmoe.data.tokenizer import Tokenizer


@dataclass
class TokensOptions:
    eval_path: str | None = None  # tokens: held-out shard dir; None = eval/ of data.path, or its tail docs
    verify: bool = False  # tokens: re-hash each tokens.bin (sha256) and rescan its ids at start-up


def _check_shard_against_model(shard: TokenShard, vocab_size: int, tok: Tokenizer) -> bool:
    """Vocab and tokenizer of a shard vs the model and the run's tokenizer (tokenizer.*); returns whether
    its ids are text of that tokenizer (bpb defined). Shards of the other known tokenizer are refused: their
    ids would train as if they were this one's; a foreign label (another runner's, synthetic ids) is read as
    ids that are no text."""
    from trmoe.data.bpe import NAME as BPE
    from trmoe.data.shards import INDEX_NAME
    from trmoe.data.tokenizer import TOKENIZER_NAME

    index, where = shard.index, shard.directory / INDEX_NAME
    if index["tokenizer"] in (TOKENIZER_NAME, BPE) and index["tokenizer"] != tok.name:
        fix = (
            "tokenizer=bpe (its tokenizer.json is read beside the shards)"
            if index["tokenizer"] == BPE
            else ("tokenizer=o200k (the default)")
        )
        raise UserError(
            f"token shard {where}: made with tokenizer {index['tokenizer']} (vocab {index['vocab_size']}), "
            f"but this run reads text with {tok.name} (vocab {tok.n_vocab}); allowed: {fix}, or shards "
            f"prepared with this run's tokenizer"
        )
    if index["vocab_size"] > vocab_size:
        raise UserError(
            f"token shard {where}: token ids up to {index['vocab_size'] - 1} "
            f"(vocab_size {index['vocab_size']}, "
            f"max id {index['max_token_id']}) do not fit model.vocab_size={vocab_size}; allowed: "
            f"model.vocab_size >= {index['vocab_size']}"
        )
    if index["tokenizer"] == tok.name:
        # a converted legacy shard hashed its tokenizer another way: its label and vocab are what is known
        if index.get("converted_from") is None and index["tokenizer_sha256"] != tok.sha256:
            what = "rank-file" if tok.name == TOKENIZER_NAME else "tokenizer.json"
            fix = (
                "re-prepare the data"
                if tok.path is None
                else (
                    "point tokenizer.path at the tokenizer.json the shards were prepared with "
                    f"(not {tok.path})"
                )
            )
            raise UserError(
                f"token shard {where}: tokenizer {tok.name} with {what} sha256 "
                f"{index['tokenizer_sha256']}, but this run's is {tok.sha256}; {fix}"
            )
        return True
    return False


def shard_tokenizer_file(data_path: str) -> Path | None:
    """The tokenizer.json `python -m trmoe.data.prepare --tokenizer bpe` wrote beside the shards of
    data.path (a dataset directory, or one of its shard directories): what tokenizer=bpe reads when
    tokenizer.path is not set. None when there is none."""
    from trmoe.data.bpe import FILE_NAME

    base = Path(data_path).expanduser().resolve()
    for folder in (base, base.parent):
        if (folder / FILE_NAME).is_file():
            return folder / FILE_NAME
    return None


def _tail_split(shard: TokenShard, eval_fraction: float, seq_len: int) -> int:
    """Hold out the last documents of a single shard: the split point is the end (EOS) of the last document
    that ends before the final max(eval_fraction x N, seq_len + 1) tokens. Reads only back to that EOS."""
    import numpy as np

    from trmoe.data.shards import INDEX_NAME

    tokens, eos = shard.tokens, shard.index["eos_id"]
    where = shard.directory / INDEX_NAME
    if eos is None:
        raise UserError(
            f"token shard {where}: has no eos_id, so its documents cannot be held out whole; "
            "set data.eval_path to a held-out shard"
        )
    n = tokens.shape[0]
    end = n - max(int(n * eval_fraction), seq_len + 1)
    chunk = 1 << 20
    while end > 0:
        start = max(0, end - chunk)
        hits = np.flatnonzero(np.asarray(tokens[start:end]) == eos)
        if hits.size:
            return start + int(hits[-1]) + 1  # train = tokens[:split] ends with EOS
        end = start
    raise UserError(
        f"token shard {where}: no document boundary (EOS) before its last "
        f"{max(int(n * eval_fraction), seq_len + 1)} "
        "tokens to hold out whole documents; set data.eval_path or lower data.eval_fraction"
    )


def _shard_dirs(cfg: Config) -> tuple[Path, Path | None]:
    from trmoe.data.shards import INDEX_NAME

    d = cfg.data
    root = Path(d.path).expanduser().resolve()
    if (root / INDEX_NAME).exists():
        return root, Path(d.eval_path).expanduser().resolve() if d.eval_path else None
    if (root / "train").is_dir():
        return root / "train", Path(d.eval_path).expanduser().resolve() if d.eval_path else root / "eval"
    if not root.exists():
        raise UserError(f"data.path={d.path}: no such directory")
    raise UserError(
        f"data.path={d.path}: not a token shard or dataset (expected {root / INDEX_NAME}, or train/ and "
        "eval/ "
        "from `python -m trmoe.data.prepare`)"
    )


def build(cfg: Config, vocab_size: int, world_size: int = 1) -> DataPipeline:
    import logging

    from trmoe.data.build import check_one_batch, pipeline, run_tokenizer
    from trmoe.data.pipeline import ShardWindows
    from trmoe.data.shards import INDEX_NAME, open_shard

    log = logging.getLogger("trmoe")
    d, t = cfg.data, cfg.trainer
    train_dir, eval_dir = _shard_dirs(cfg)
    tok = run_tokenizer(cfg)
    train_shard = open_shard(train_dir, verify=d.verify)
    if train_shard.index["partition"] != "train":
        raise UserError(
            f"token shard {train_dir / INDEX_NAME}: partition is {train_shard.index['partition']!r}; "
            "training on "
            "a held-out shard would mix eval into train"
        )
    is_text = _check_shard_against_model(train_shard, vocab_size, tok)
    if d.verify:
        log.info("data: verified sha256 and token ids of %s", train_dir)
    name = f"token shard {train_dir}"
    if eval_dir is not None:
        eval_shard = open_shard(eval_dir, verify=d.verify)
        if eval_shard.index["partition"] != "eval":
            raise UserError(
                f"token shard {eval_dir / INDEX_NAME}: partition is {eval_shard.index['partition']!r}; "
                "the held-out shard must be an eval partition"
            )
        if eval_shard.index["sha256"] == train_shard.index["sha256"]:
            raise UserError(f"token shard {eval_dir}: is identical to the training shard {train_dir}")
        for key in ("tokenizer", "tokenizer_sha256"):
            if eval_shard.index[key] != train_shard.index[key]:
                raise UserError(
                    f"token shard {eval_dir / INDEX_NAME}: {key} {eval_shard.index[key]!r} differs from the "
                    f"training shard's {train_shard.index[key]!r}"
                )
        _check_shard_against_model(eval_shard, vocab_size, tok)
        if d.verify:
            log.info("data: verified sha256 and token ids of %s", eval_dir)
        train_tokens, eval_tokens = train_shard.tokens, eval_shard.tokens
        eval_name = f"token shard {eval_dir}"
        split = {
            "rule": "separate shards",
            "train": train_shard.fingerprint(),
            "eval": eval_shard.fingerprint(),
        }
    else:
        cut = _tail_split(train_shard, d.eval_fraction, t.seq_len)
        train_tokens, eval_tokens = train_shard.tokens[:cut], train_shard.tokens[cut:]
        eval_name = f"{name} (tail)"
        split = {
            "rule": "held-out tail: the documents after token index split_token (an EOS boundary)",
            "eval_fraction": d.eval_fraction,
            "split_token": cut,
            "train": train_shard.fingerprint(),
            "eval": None,
        }
    train = ShardWindows(train_tokens, t.seq_len, d.order.value, t.seed, name=name, vocab_size=vocab_size)
    check_one_batch(train.num_windows, cfg, name)
    held_out = ShardWindows(eval_tokens, t.seq_len, "sequential", 0, name=eval_name, vocab_size=vocab_size)
    train_fixed = ShardWindows(train_tokens, t.seq_len, "sequential", 0, name=name, vocab_size=vocab_size)
    if not is_text:
        log.info(
            "data: tokenizer %r is not %s text: eval_bpb is NaN",
            train_shard.index["tokenizer"],
            tok.name,
        )
    info = {
        "source": "tokens",
        "shards": split,
        "tokenizer": train_shard.index["tokenizer"],
        "tokenizer_sha256": train_shard.index["tokenizer_sha256"],
        "order": d.order.value,
        "train_windows": train.num_windows,
        "eval_windows": held_out.num_windows,
    }
    streams = (
        f"the first windows of {name} in file order (training data, not held out)",
        f"the first windows of {eval_name} (held-out documents)",
    )
    identity = [
        ("training shard sha256", split["train"]["sha256"]),
        ("held-out shard sha256", split["eval"] and split["eval"]["sha256"]),
        ("split token", split.get("split_token")),
    ]
    return pipeline(
        t,
        train,
        held_out,
        info,
        fixed=train_fixed,
        text=is_text,
        streams=streams,
        identity=identity,
        tokenizer=tok,
    )


def validate(d: Any, where: str = "data") -> None:
    if not d.path:
        if where == "data":
            fail("data.path", d.path, "data=tokens needs a shard directory: data.path=/path/to/dataset")
        fail(f"{where}.path", None, f"a tokens source needs {where}.path")


def counts(d: Any) -> Path | None:
    """The token_counts.npy that `python -m trmoe.data.prepare` writes beside the shards of data.path."""
    from trmoe.data.shards import TOKEN_COUNTS_NAME

    if not d.path:
        return None
    base = Path(d.path).expanduser().absolute()
    return (base if base.is_dir() else base.parent) / TOKEN_COUNTS_NAME


VARIANT = DataSourceVariant(
    "tokens", build=build, options=TokensOptions, validate=validate, counts=counts, order=3,
    doc="memory-mapped token shards written by `python -m trmoe.data.prepare`",
    mixture_keys=("path", "eval_path", "order"), inherit=("order",), exclusive=("path", "eval_path"),
    split="separate shards (or held-out tail documents)", example=("data.path=data/corpus",),
    sample="window of a seeded permutation (or sequential)",
)  # fmt: skip
