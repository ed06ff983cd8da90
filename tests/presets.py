"""The tiny runs the tests train: one list of overrides per kind of run, each named for what it is for.

A test adds its own knobs (steps, cadence, the option under test) on top: `[*TINY_RUN, "trainer.steps=4"]`.
hardware.threads=1 wherever results are compared: one thread in every process makes CPU results
bit-identical. Test modules import these from here, never from one another."""

from __future__ import annotations

# In-process train() runs of a few milliseconds a step: 256 ids, 16-token windows, one thread.
FAST_CPU = [
    "trainer.seq_len=16",
    "trainer.eval_batches=1",
    "hardware=cpu",
    "hardware.threads=1",
    "run.progress=log",
    "data=random",
    "model.vocab_size=256",
]


# A training run of a few milliseconds a step (tiny vocabulary, short sequences): the sweep tests' base.
TINY_RUN = [
    "data=random",
    "model.vocab_size=512",
    "trainer.micro_batch=2",
    "trainer.seq_len=32",
    "optimizer.lr=3e-3",
    "optimizer.warmup_steps=2",
    "trainer.eval_batches=1",
    "run.progress=log",
    "trainer.log_every=10",
]


# A tiny model (o200k vocabulary) trained to memorise a few sentences: conftest's text_run fixture, which
# trmoe.sample, trmoe.export and trmoe.eval are tested on.
TRAINING_SENTENCES = [
    "The cat sat on the mat and looked at the red ball.",
    "A quick brown fox jumps over the lazy dog every morning.",
    "Water boils at one hundred degrees at sea level.",
    "The sun rises in the east and sets in the west.",
]


TEXT_RUN = [
    "model=tiny",
    "data=text",
    "data.eval_fraction=0.2",
    "hardware=cpu",
    "hardware.threads=1",
    "run.progress=log",
    "trainer.seq_len=32",
    "trainer.micro_batch=4",
    "trainer.steps=60",
    "trainer.eval_every=0",
    "trainer.eval_batches=1",
    "trainer.log_every=20",
    "optimizer.lr=1e-2",
    "optimizer.warmup_steps=5",
]


RESUME_BASE = [
    "data=random",
    "model.vocab_size=512",
    "trainer.micro_batch=4",
    "trainer.seq_len=64",
    "optimizer.lr=3e-3",
    "optimizer.warmup_steps=3",
    "trainer.eval_batches=2",
    "hardware=cpu",
    "hardware.threads=1",  # the same thread count in every process: CPU results are then bit-identical
    "run.progress=log",
    "run.name=r",
    "trainer.steps=20",
    "trainer.log_every=3",  # rows at 1, 3, 5, 6, 9, ...: windows straddle checkpoints (every 4)
    "trainer.eval_every=5",
    "checkpoint.every_steps=4",
    "checkpoint.keep_last=2",
]


RESUME_SMALL = ["trainer.steps=4", "checkpoint.every_steps=2", "trainer.log_every=1", "trainer.eval_every=2"]

# The tiny model at a quarter of its width, for runs on o200k text whose property does not depend on the
# width: the [200019, H] embedding and tied output layer are most of the tiny model's cost (a step, a
# checkpoint), so a quarter of H is about a quarter of the run (test_mixture: 64 s -> 39 s).
O200K_NARROW = ["model.hidden_size=16"]

# 16-token windows on one thread, for runs on a prepared or text dataset (data= set by the test)
DATA_FAST = [
    *O200K_NARROW,
    "trainer.seq_len=16",
    "trainer.eval_batches=2",
    "hardware=cpu",
    "hardware.threads=1",
    "run.progress=log",
]

# Random ids of a 512-id vocabulary in 32-token windows on one CPU thread, the default micro-batch: the base
# of the world-size comparisons and the learned-router runs.
RANDOM_IDS_CPU = [
    "data=random",
    "model.vocab_size=512",
    "trainer.seq_len=32",
    "optimizer.lr=3e-3",
    "optimizer.warmup_steps=2",
    "trainer.eval_batches=1",
    "hardware=cpu",
    "hardware.threads=1",
    "run.progress=log",
]

# 4 steps on random ids, a row per step: the world-size comparisons (torchrun ranks) (test_distributed.py)
DISTRIBUTED_TINY = [*RANDOM_IDS_CPU, "trainer.steps=4", "trainer.log_every=1"]

# 2 steps of 2 x 16 tokens on one thread: a grid's every arm in seconds (the arms set model and data)
# (test_experiments.py)
GRID_TINY = [
    "trainer.steps=2",
    "trainer.micro_batch=2",
    "trainer.seq_len=16",
    "trainer.eval_batches=1",
    "trainer.eval_every=0",
    "trainer.log_every=1",
    "hardware.threads=1",
    "checkpoint.enabled=false",  # a 13M-parameter arm's checkpoint is 150 MB, and no grid test reads one
]

# rows and evaluations at the ends only: a run whose steps must not wait on the host (test_host_sync.py)
HOST_SYNC_RUN = [
    "trainer.micro_batch=2",
    "trainer.seq_len=32",
    "trainer.eval_batches=1",
    "trainer.eval_every=0",  # held-out evaluation at the end only
    "trainer.log_every=1000",  # metrics rows at step 1 and the last step only
    "checkpoint.every_steps=0",
    "hardware=cpu",
    "run.progress=log",
    "data=random",
    "model=tiny",
    "model.vocab_size=512",
]

# the learned router with its z-loss and MoE telemetry on random ids (test_learned_router.py)
LEARNED_RUN = [*RANDOM_IDS_CPU, "routing=learned", "routing.z_weight=0.001", "telemetry.moe=true"]

# 4 x 32-token micro-batches on random ids: the loss backends' runs (test_loss_backends.py)
LOSS_FAST = [
    "trainer.micro_batch=4",
    "trainer.seq_len=32",
    "trainer.eval_batches=1",
    "hardware=cpu",
    "hardware.threads=1",
    "run.progress=log",
    "data=random",
    "model.vocab_size=512",
]

# 2 x 32 tokens on random ids: runs that are killed, locked or run out of disk (test_reliability.py)
RELIABILITY_TINY = [
    "data=random",
    "model.vocab_size=512",
    "trainer.micro_batch=2",
    "trainer.seq_len=32",
    "trainer.eval_batches=1",
    "run.progress=log",
    "hardware=cpu",
    "hardware.threads=1",
]

# 4 x 64 tokens (data and vocabulary set by the test): the train loop's runs (test_train.py)
TRAIN_FAST = [
    "trainer.micro_batch=4",
    "trainer.seq_len=64",
    "optimizer.lr=3e-3",
    "optimizer.warmup_steps=5",
    "trainer.eval_batches=2",
    "hardware=cpu",
    "run.progress=log",
]
