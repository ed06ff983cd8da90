"""`python -m trmoe.sample <run | checkpoint> [--step N] --prompt TEXT ... | --prompt-file F [options]`

Generates from a trained model with a KV cache: greedy or sampled (temperature, top-k, top-p, seed), up to
--max-new-tokens per prompt, stopping at the end-of-text token or a --stop string. Prints each prompt and its
continuation, or writes one JSON object a line to --out (never over an existing file). Bad input (no such
run or step, an empty prompt, a negative count): one line, exit code 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

from trmoe import cli
from trmoe.cli import Parser
from trmoe.data.tokenizer import O200K_VOCAB
from trmoe.durable import json_text, write_file
from trmoe.errors import UserError


def _parser() -> Parser:
    p = Parser(prog="python -m trmoe.sample", description=__doc__.split("\n\n")[1])
    p.add_argument("run", type=Path, help="run directory, its checkpoints/ directory or one checkpoint")
    p.add_argument(
        "--step", type=int, default=None, help="checkpoint step (default: the newest complete one)"
    )
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    p.add_argument("--prompt-file", type=Path, default=None, help="UTF-8 file, one prompt a line")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--greedy", action="store_true", help="always the most likely token")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (1: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop a continuation at this string")
    p.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | rocm | mps")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16 | fp16")
    p.add_argument("--out", type=Path, default=None, help="write JSONL here instead of printing")
    return p


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompt_file is not None:
        try:
            text = args.prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(
                f"--prompt-file {args.prompt_file}: unreadable ({e}); allowed: a UTF-8 file"
            ) from None
        prompts += [line.replace("\\n", "\n") for line in text.splitlines()]
    if not prompts:
        raise UserError("no prompt: allowed: --prompt TEXT (repeatable) or --prompt-file FILE")
    for i, prompt in enumerate(prompts, 1):
        if not prompt:
            raise UserError(f"prompt {i} is empty; allowed: a prompt of at least one character")
    return prompts


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """text up to the first stop string (excluded) and whether one was found."""
    cuts = [text.find(s) for s in stops if s and s in text]
    return (text[: min(cuts)], True) if cuts else (text, False)


def run(argv: list[str] | None = None) -> list[dict]:
    args = _parser().parse_args(argv)
    prompts = read_prompts(args)
    if args.batch_size < 1:
        raise UserError(f"--batch-size {args.batch_size}: allowed: 1 or more")
    if args.out is not None and args.out.exists():
        raise UserError(f"--out {args.out}: exists (nothing is overwritten); allowed: a new file")
    from trmoe.generate import Sampling, generate
    from trmoe.load import load_model

    s = Sampling(args.max_new_tokens, args.greedy, args.temperature, args.top_k, args.top_p, args.seed)
    s.check()
    loaded = load_model(args.run, args.step, device=args.device, dtype=args.dtype)
    loaded.model.refuse_analysis_only(f"sampling {args.run}")
    if not loaded.text_vocab:
        raise UserError(
            f"run {args.run}: its model reads {loaded.spec.vocab_size} token ids, not o200k_base text "
            f"(model.vocab_size={O200K_VOCAB}) or a tokenizer=bpe's; allowed: a run trained on text"
        )
    enc = loaded.tokenizer()  # o200k_base, or the run's tokenizer=bpe
    eos = enc.eos_id
    records = []
    for first in range(0, len(prompts), args.batch_size):
        chunk = prompts[first : first + args.batch_size]
        ids = [enc.encode(p, allowed_special="all") for p in chunk]

        def done(row: int, new: list[int]) -> bool:
            return bool(args.stop) and cut_at_stop(enc.decode(new), args.stop)[1]

        for prompt, new in zip(chunk, generate(loaded.model, ids, s, eos_id=eos, done=done), strict=True):
            ended = bool(new) and new[-1] == eos
            text, stopped = cut_at_stop(enc.decode(new[:-1] if ended else new), args.stop)
            reason = "stop" if stopped else "eos" if ended else "length"
            records.append(
                {
                    "prompt": prompt,
                    "completion": text,
                    "new_tokens": len(new),
                    "finish": reason,
                    "step": loaded.step,
                }
            )
    if args.out is not None:
        text = "".join(json_text(r, ensure_ascii=False) + "\n" for r in records)
        try:
            write_file(args.out, text, fsync=False)
        except OSError as e:
            raise UserError(f"--out {args.out}: cannot write ({e.strerror or e})") from None
    else:
        for r in records:
            print(r["prompt"] + r["completion"], end="\n---\n")
    return records


def main(argv: list[str] | None = None) -> int:
    return cli.run(run, argv)


if __name__ == "__main__":
    sys.exit(main())
