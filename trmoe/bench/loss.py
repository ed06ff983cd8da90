"""`loss`: peak memory and time of the tied-head loss paths vs full logits, vocab 200,019.

Each case runs in its own subprocess so its peak resident memory (ru_maxrss) is its own; the extra memory
of a case is its peak minus the peak of a baseline process holding the same inputs. Target: the chunked
path's extra peak <= 2 x chunk_tokens x vocab x 4 bytes, independent of the number of tokens.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

VOCAB = 200_019


def _case(kind: str, tokens: int, hidden: int, chunk: int) -> dict:
    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, requires_grad=True)
    w = (torch.randn(VOCAB, hidden) * 0.02).requires_grad_()
    y = torch.randint(0, VOCAB, (tokens,))
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if kind == "chunked":
        from trmoe.train.loss import chunked_tied_ce

        s = chunked_tied_ce(h, w, y, chunk_tokens=chunk)
        (s.total / tokens).backward()
    elif kind == "torch":
        loss = F.linear_cross_entropy(h, w, y)
        loss.backward()
    elif kind == "full":
        F.cross_entropy(h @ w.T, y).backward()
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": elapsed, "extra_peak_bytes": (peak - base_rss) * 1024}


def run(token_counts: list[int], hidden: int, chunk: int, kinds: list[str], max_gb: float) -> list[dict]:
    from trmoe.bench.common import record

    results = []
    for tokens in token_counts:
        for kind in kinds:
            full_bytes = 3 * tokens * VOCAB * 4  # logits, softmax grad, a temporary
            if kind == "full" and full_bytes > max_gb * 2**30:
                results.append(
                    record(
                        "loss",
                        {"kind": kind, "tokens": tokens, "skipped": f"needs ~{full_bytes / 2**30:.0f} GB"},
                    )
                )
                continue
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "trmoe.bench.loss",
                    "--child",
                    kind,
                    str(tokens),
                    str(hidden),
                    str(chunk),
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            measured = json.loads(out.stdout.strip().splitlines()[-1])
            bound = 2 * chunk * VOCAB * 4
            results.append(
                record(
                    "loss",
                    {
                        "kind": kind,
                        "tokens": tokens,
                        "hidden": hidden,
                        "vocab": VOCAB,
                        "chunk_tokens": chunk if kind == "chunked" else None,
                        **measured,
                        "chunked_bound_bytes": bound if kind == "chunked" else None,
                    },
                )
            )
    return results


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--child":
        kind, tokens, hidden, chunk = argv[1], int(argv[2]), int(argv[3]), int(argv[4])
        print(json.dumps(_case(kind, tokens, hidden, chunk)))
        return
    parser = argparse.ArgumentParser(prog="python -m trmoe.bench loss", description=__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--kinds", nargs="+", default=["chunked", "torch", "full"])
    parser.add_argument("--max-gb", type=float, default=12.0, help="skip full logits needing more than this")
    args = parser.parse_args(argv)
    for r in run(args.tokens, args.hidden, args.chunk, args.kinds, args.max_gb):
        if "skipped" in r:
            print(f"{r['kind']:>8} {r['tokens']:>6} tokens: skipped ({r['skipped']})")
        else:
            print(
                f"{r['kind']:>8} {r['tokens']:>6} tokens: {r['seconds']:.2f} s, extra peak "
                f"{r['extra_peak_bytes'] / 2**20:,.0f} MiB"
            )


if __name__ == "__main__":
    main()
