"""The batch arithmetic a config implies, in one place (torch-free): every module that needs how many
samples or tokens a step, a micro-batch or an evaluation holds asks here, so that the training loop, the
resume checks, run_config.json's `derived`, the planner, the benchmarks and the data builders can never
disagree.

    micro-batch     micro_batch samples of seq_len tokens           micro_batch_tokens
    one rank's step micro_batch x grad_accum samples                rank_batch_samples
    one step        micro_batch x grad_accum x world samples        global_batch_samples
                    ... x seq_len tokens (tokens per step)          global_batch_tokens
    an evaluation   eval_batches x micro_batch windows               eval_windows (held_out_change)
                    ... x seq_len tokens scored (at most: a         eval_tokens
                    smaller held-out split scores what it holds)

The data layer below the config (trmoe/data, except data/build.py) never imports this: its functions take
these numbers as arguments (`pipeline.micro_batch_samples`, `sampler.eval_batches`).
"""

from __future__ import annotations

from trmoe.config.schema import TrainerConfig


def micro_batch_tokens(t: TrainerConfig) -> int:
    """Tokens of one micro-batch (one forward and backward): micro_batch x seq_len."""
    return t.micro_batch * t.seq_len


def rank_batch_samples(t: TrainerConfig) -> int:
    """Samples (sequences) one rank reads per optimizer step: micro_batch x grad_accum."""
    return t.micro_batch * t.grad_accum


def global_batch_samples(t: TrainerConfig, world_size: int) -> int:
    """B, the global batch in samples of one optimizer step: micro_batch x grad_accum x world."""
    return rank_batch_samples(t) * world_size


def global_batch_tokens(t: TrainerConfig, world_size: int) -> int:
    """Tokens per step: micro_batch x seq_len x world x grad_accum (the loop, resume checks, the planner;
    run_config.json's derived.global_batch_tokens)."""
    return global_batch_samples(t, world_size) * t.seq_len


def eval_windows(t: TrainerConfig) -> int:
    """The held-out set's size in windows: its first eval_batches x micro_batch (docs/data.md;
    run_config.json's derived.eval_windows)."""
    return t.eval_batches * t.micro_batch


def eval_tokens(t: TrainerConfig) -> int:
    """Tokens scored per evaluation: eval_batches x micro_batch x seq_len (when the held-out split holds that
    many windows; a smaller one scores what it holds)."""
    return eval_windows(t) * t.seq_len


def held_out_change(parent_windows: int, t: TrainerConfig) -> str | None:
    """What a run of `t` says when its parent (a branch's) scored `parent_windows` held-out windows and it
    scores another number (another micro_batch split of the same tokens per step, another eval_batches):
    another set, with the eval_batches that scores the parent's; None when they are equal."""
    ours, batch = eval_windows(t), t.micro_batch
    if parent_windows == ours:
        return None
    hint = (
        "" if parent_windows % batch else f"; trainer.eval_batches={parent_windows // batch} scores its set"
    )
    return (
        f"the parent scored {parent_windows} held-out windows, this run scores {ours} "
        f"(trainer.eval_batches x micro_batch): its eval_loss is not comparable with the parent's{hint}"
    )
