"""The token embedding that clustered_hash and dispersed_hash build their route tables from (Roller et al.
2021's clustered vs dispersed hashes), and its k-means clusters.

Sources (`routing.embedding`): a ``[V, H]`` array in a ``.npy`` file; a ``.pt``/``.pth`` file holding a
tensor or a state dict with ``embed.weight`` (a trmoe checkpoint's ``model_optim.pt`` holds it under
``model``); a ``.safetensors`` file with ``embed.weight`` or ``model.embed.weight``; or a directory holding
one ``model.safetensors`` (what ``python -m trmoe.export`` writes, either format). The rows are token ids:
exactly ``V = model.vocab_size``, or ``V`` plus fewer than 256 padding rows (a trmoe embedding padded by
model.vocab_pad_multiple), which are dropped. Every value must be finite (k-means over a NaN or inf row
would cluster nothing meaningful). A file that is not what its suffix says (a text file named .npy, a .pt
holding objects weights_only refuses, a damaged .safetensors) is a ValueError naming the file, never the
reader's own advice (numpy's `allow_pickle`, torch's `weights_only`), which no trmoe option reaches.

Clusters: the rows scaled to unit length (cosine geometry), ``E`` k-means centroids
(scipy.cluster.vq.kmeans2, k-means++ initialisation, 20 iterations, its generator seeded by
``(routing.seed mod 2^32, 0x5EEDC1A5)``): one clustering per (embedding, E, seed), shared by the layers.
"""

from __future__ import annotations

import functools
import hashlib
import warnings
from pathlib import Path

import numpy as np

MAX_PADDING = 256
_CLUSTER_SALT = 0x5EEDC1A5
_KEYS = ("embed.weight", "model.embed.weight")


def _from_mapping(state: dict, source: Path) -> object:
    if "model" in state and isinstance(state["model"], dict):  # a trmoe checkpoint payload
        state = state["model"]
    for key in _KEYS:
        if key in state:
            return state[key]
    raise ValueError(f"{source}: holds no {' or '.join(_KEYS)}")


def embedding_file(path: str | Path) -> Path:
    """The file a source names (a directory: its model.safetensors). ValueError when there is none."""
    source = Path(path).expanduser()
    if source.is_dir():
        source = source / "model.safetensors"
    if not source.is_file():
        raise ValueError(f"{source}: no such file")
    return source


def load_embedding(path: str | Path, vocab_size: int) -> np.ndarray:
    """The ``[vocab_size, H]`` float32 embedding of a source (module docstring). ValueError naming the file
    and what is wrong: missing, unreadable, not 2-D, rows that are not the vocabulary, values not finite."""
    source = embedding_file(path)
    if source.suffix not in READERS:
        raise ValueError(f"{source}: allowed: a .npy, .pt, .pth or .safetensors file, or an export dir")
    try:
        array = np.asarray(_read(source))  # (a ragged object a .pt held fails here)
    except ValueError as e:
        if str(e).startswith(str(source)):  # ours (_from_mapping): already says what is wrong
            raise
        raise _unreadable(source, e) from None
    except (
        Exception
    ) as e:  # whatever the reader raises on bytes that are not its format (pickle, safetensors)
        raise _unreadable(source, e) from None
    if array.ndim != 2 or array.dtype.kind != "f":
        raise ValueError(
            f"{source}: a token embedding is a 2-D float array [V, H], got {array.dtype} {array.shape}"
        )
    rows = array.shape[0]
    if not vocab_size <= rows < vocab_size + MAX_PADDING:
        raise ValueError(
            f"{source}: {rows} rows for model.vocab_size={vocab_size}; allowed: {vocab_size} rows (plus "
            f"fewer than {MAX_PADDING} padding rows)"
        )
    array = np.ascontiguousarray(array[:vocab_size], dtype=np.float32)
    bad = ~np.isfinite(array).all(axis=1)
    if bad.any():
        raise ValueError(
            f"{source}: {int(bad.sum())} rows hold NaN or inf (the first: token id {int(bad.argmax())}); "
            "allowed: finite values"
        )
    return array


READERS = (".npy", ".pt", ".pth", ".safetensors")


def _unreadable(source: Path, e: BaseException) -> ValueError:
    formats = {".npy": "a .npy array", ".safetensors": "a safetensors file"}
    what = formats.get(source.suffix, "a torch tensor or state dict")
    said = str(e).splitlines()[0] if str(e) else ""
    if "pickle" in said.lower() or "weights only" in said.lower():
        # the reader's own advice (allow_pickle=True, weights_only=False) is no trmoe option: say what it is
        detail = "it holds pickled Python objects, which are never unpickled here"
    else:
        detail = f"{type(e).__name__}: {said[:120]}" if said else type(e).__name__
    return ValueError(f"{source}: not readable as {what} ({detail})")


def _read(source: Path) -> object:
    """The array a file holds (a numpy array or a float tensor's), as its suffix says to read it."""
    import torch

    if source.suffix == ".npy":
        with open(source, "rb") as f:
            # numpy takes a file without its magic for a pickle and says so: name what it really is
            if f.read(6) != b"\x93NUMPY":
                raise ValueError("no .npy header (numpy.save writes one)")
        return np.load(source, allow_pickle=False)
    if source.suffix == ".safetensors":
        from safetensors.numpy import load_file

        return _from_mapping(load_file(str(source)), source)
    with warnings.catch_warnings():  # (torch warns of pickle protocols on stderr: the error says it all)
        warnings.simplefilter("ignore")
        loaded = torch.load(source, map_location="cpu", weights_only=True)
    array = _from_mapping(loaded, source) if isinstance(loaded, dict) else loaded
    if isinstance(array, torch.Tensor):
        array = array.float().numpy()
    return array


def embedding_digest(path: str | Path) -> str:
    """The sha256 of the file the embedding is read from (a directory's model.safetensors)."""
    with open(embedding_file(path), "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def embedding_record(path: str | Path, vocab_size: int) -> dict:
    """run_config.json's record of the source: its file, sha256, and the shape the tables read."""
    source = embedding_file(path)
    digest = embedding_digest(source)
    width = load_embedding(source, vocab_size).shape[1]
    return {"path": str(source.resolve()), "sha256": digest, "rows": vocab_size, "width": width}


def clusters(path: str, vocab_size: int, num_experts: int, seed: int) -> np.ndarray:
    """[V] int64: the k-means cluster (0..E-1) of every token id (module docstring)."""
    source = embedding_file(path)
    stat = source.stat()
    return _clusters(str(source.resolve()), stat.st_mtime_ns, stat.st_size, vocab_size, num_experts, seed)


@functools.lru_cache(maxsize=4)
def _clusters(path: str, _mtime: int, _size: int, vocab_size: int, num_experts: int, seed: int) -> np.ndarray:
    from scipy.cluster.vq import kmeans2

    rows = load_embedding(path, vocab_size).astype(np.float64)
    rows /= np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)
    rng = np.random.default_rng([seed & 0xFFFFFFFF, _CLUSTER_SALT])
    _, labels = kmeans2(rows, num_experts, iter=20, minit="++", seed=rng)
    return labels.astype(np.int64)
