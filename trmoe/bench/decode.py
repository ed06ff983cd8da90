"""`decode`: generation speed, tokens per second, with the KV cache and with a full recompute per token.

Each model profile (randomly initialised: speed does not depend on the weights) decodes --new-tokens greedy
tokens after a --prompt-tokens prompt for each batch size, through trmoe.generate (prefill once, then one
position per step with the cache) and through a full forward of the whole sequence per new token, the two
timed round-robin in one run. tok/s counts new tokens of all rows (batch x new tokens / seconds).
"""

from __future__ import annotations

import functools

import torch

from trmoe.bench.common import Parser, add_device, paired_ratio, positive_int, record, time_interleaved
from trmoe.config.resolve import compose_packaged, to_config
from trmoe.config.spec import model_spec
from trmoe.generate import Sampling, generate
from trmoe.model.transformer import TRMoETransformer


@torch.no_grad()
def _recompute(model: TRMoETransformer, prompts: torch.Tensor, new: int) -> None:
    ids = prompts
    for _ in range(new):
        token = model.logits(model(ids)[:, -1]).argmax(-1, keepdim=True)
        ids = torch.cat([ids, token], dim=1)


def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog="python -m trmoe.bench decode", description=__doc__)
    parser.add_argument("--models", default="tiny,100m", help="comma-separated model profiles (conf/model)")
    parser.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--prompt-tokens", type=positive_int, default=16)
    parser.add_argument("--new-tokens", type=positive_int, default=32)
    parser.add_argument("--reps", type=positive_int, default=3)
    add_device(parser)
    args = parser.parse_args(argv)
    try:
        batches = [int(b) for b in args.batch.split(",")]
        assert all(b >= 1 for b in batches)
    except (ValueError, AssertionError):
        parser.error(f"--batch {args.batch}: allowed: comma-separated whole numbers >= 1")
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    for name in args.models.split(","):
        spec = model_spec(to_config(compose_packaged([f"model={name}"])))
        torch.manual_seed(0)
        model = TRMoETransformer(spec).to(device=device, dtype=dtype).eval()
        for batch in batches:
            prompts = torch.randint(0, spec.vocab_size, (batch, args.prompt_tokens), device=device)
            rows = prompts.tolist()
            s = Sampling(max_new_tokens=args.new_tokens, greedy=True)
            cases = {
                "kv_cache": functools.partial(generate, model, rows, s),
                "recompute": functools.partial(_recompute, model, prompts, args.new_tokens),
            }
            timings = time_interleaved(cases, device, warmup=1, reps=args.reps)
            per_s = {k: batch * args.new_tokens / v["median_s"] for k, v in timings.items()}
            r = record(
                "decode",
                {
                    "model": name,
                    "batch": batch,
                    "prompt_tokens": args.prompt_tokens,
                    "new_tokens": args.new_tokens,
                    "device": str(device),
                    "dtype": str(dtype).replace("torch.", ""),
                    "timings": timings,
                    "tok_s": per_s,
                    "speedup": 1.0 / paired_ratio(timings, "kv_cache", "recompute"),
                },
            )
            print(
                f"{name:>6} batch {batch}: {per_s['kv_cache']:8.1f} tok/s with the KV cache, "
                f"{per_s['recompute']:8.1f} tok/s recomputing ({r['speedup']:.2f}x)"
            )
