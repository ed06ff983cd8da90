"""`python -m trmoe.plan`: what a run will cost, from the config the run uses, before anything is launched.

trmoe.plan.build composes and validates the config exactly as `python -m trmoe.train` does and computes the
plan (parameters, tokens per step, steps, FLOPs, memory per GPU, ETA); trmoe.plan.memory holds the memory
model; the FLOPs formula is trmoe.model.flops (shared with `python -m trmoe.bench step`). docs/distributed.md
("Planning a large run") explains the figures and their assumptions.
"""
