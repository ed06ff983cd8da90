"""The training loss: the exact tied-head cross-entropy computed in chunks (tied) and the backends that
produce it (backend: chunked, torch, liger)."""
