"""The checkpoint store on its own: layout, pruning, verification, and torch.distributed.checkpoint with two
real gloo ranks. (The end-to-end guarantees: tests/test_resume.py, test_launch.py and test_guards.py.)"""

from __future__ import annotations

import json
import shutil
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import compose_config, spawn_ranks

from trmoe.run.checkpoint import (
    CheckpointError,
    CheckpointStore,
    load_checkpoint,
    read_pointer,
    resolve_checkpoint,
)
from trmoe.runtime import distributed
from trmoe.train.loop import train


def _model_and_optimizer(seed: int = 0, steps: int = 1):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    for _ in range(steps):
        model(torch.randn(5, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def _assert_same(a: torch.nn.Module, b: torch.nn.Module, oa, ob) -> None:
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb), ka
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    for index in sa:
        for name in sa[index]:
            assert torch.equal(sa[index][name], sb[index][name]), (index, name)


@pytest.mark.parametrize("fmt", ["torch", "dcp"])
def test_save_load_round_trip_and_layout(tmp_path, fmt):
    model, optimizer = _model_and_optimizer(steps=3)
    store = CheckpointStore(tmp_path, keep_last=2, format=fmt)
    store.save(3, model=model, optimizer=optimizer, local_state={"rng": 7}, meta={"tokens": 30})
    info = store.verify(tmp_path / "step_00000003")
    assert info.step == 3 and info.meta["tokens"] == 30 and info.meta["format"] == fmt
    assert read_pointer(tmp_path) == "step_00000003"
    assert set(info.meta["files"]) == {p.name for p in info.path.iterdir()} - {"meta.json"}
    fresh, fresh_opt = _model_and_optimizer(seed=1, steps=1)
    assert store.load(info, model=fresh, optimizer=fresh_opt) == {"rng": 7}
    _assert_same(model, fresh, optimizer, fresh_opt)


def test_keep_last_prunes_oldest_and_never_the_newest(tmp_path):
    model, optimizer = _model_and_optimizer()
    store = CheckpointStore(tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        store.save(step, model=model, optimizer=optimizer, local_state={}, meta={})
    assert [s for s, _ in store.step_dirs()] == [3, 4]
    one = CheckpointStore(tmp_path, keep_last=1)
    one.save(5, model=model, optimizer=optimizer, local_state={}, meta={})
    assert [s for s, _ in one.step_dirs()] == [5] and read_pointer(tmp_path) == "step_00000005"
    every = CheckpointStore(tmp_path, keep_last=0)
    every.save(6, model=model, optimizer=optimizer, local_state={}, meta={})
    every.save(7, model=model, optimizer=optimizer, local_state={}, meta={})
    assert [s for s, _ in every.step_dirs()] == [5, 6, 7]


def test_checkpoints_asked_for_by_step_are_never_pruned_by_keep_last(tmp_path):
    """checkpoint.at_steps saves were asked for by step: keep_last counts the others (it pruned them with no
    notice); the newest is still never pruned."""
    model, optimizer = _model_and_optimizer()
    store = CheckpointStore(tmp_path, keep_last=1, every_steps=1, at_steps=(2, 3))
    for step in (1, 2, 3, 4, 5):
        store.save(step, model=model, optimizer=optimizer, local_state={}, meta={})
    assert [s for s, _ in store.step_dirs()] == [2, 3, 5] and read_pointer(tmp_path) == "step_00000005"
    newest_asked = CheckpointStore(tmp_path, keep_last=1, at_steps=(6,))
    newest_asked.save(6, model=model, optimizer=optimizer, local_state={}, meta={})
    assert [s for s, _ in newest_asked.step_dirs()] == [5, 6]  # 2 and 3 are this config's periodic ones now


def test_a_kill_inside_a_re_save_of_a_step_keeps_that_step(tmp_path, monkeypatch):
    """A re-save of the same step (a spike rollback's) sets the old copy aside, then moves the new one in.
    Killed between the two renames, the set-aside copy is that checkpoint: found, verified and loaded, and
    put back under its name by the next save (it was deleted as a leftover, the run restarted from 0)."""
    import os

    model, optimizer = _model_and_optimizer(steps=2)
    store = CheckpointStore(tmp_path, keep_last=1)
    store.save(5, model=model, optimizer=optimizer, local_state={"copy": "first"}, meta={})
    real_rename, renames = os.rename, []

    def killed_after_the_first(src, dst):
        renames.append(dst)
        if len(renames) == 2:
            raise KeyboardInterrupt  # the process dies here: nothing after runs
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", killed_after_the_first)
    with pytest.raises(KeyboardInterrupt):
        store.save(5, model=model, optimizer=optimizer, local_state={"copy": "second"}, meta={})
    monkeypatch.setattr(os, "rename", real_rename)
    (tmp_path / ".step_00000005.tmp").mkdir(exist_ok=True)  # the kill also leaves the new copy's directory
    assert not (tmp_path / "step_00000005").exists()
    found = store.newest_good()
    assert found is not None and found.step == 5
    fresh, fresh_opt = _model_and_optimizer(seed=1)
    assert store.load(found, model=fresh, optimizer=fresh_opt) == {"copy": "first"}
    _assert_same(model, fresh, optimizer, fresh_opt)
    store.save(6, model=model, optimizer=optimizer, local_state={}, meta={})  # keep_last=1: 6 alone stays
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000006"]
    keep = CheckpointStore(tmp_path / "b", keep_last=0)
    keep.save(5, model=model, optimizer=optimizer, local_state={}, meta={})
    (tmp_path / "b" / "step_00000005").rename(tmp_path / "b" / ".step_00000005.old")
    keep.save(6, model=model, optimizer=optimizer, local_state={}, meta={})  # the leftover goes back
    assert [s for s, _ in keep.step_dirs()] == [5, 6] and (tmp_path / "b" / "step_00000005").is_dir()


def test_unusable_checkpoints_are_reported_and_skipped(tmp_path, caplog):
    model, optimizer = _model_and_optimizer()
    store = CheckpointStore(tmp_path, keep_last=0)
    for step in (1, 2, 3):
        store.save(step, model=model, optimizer=optimizer, local_state={}, meta={})
    (tmp_path / "step_00000003" / "meta.json").write_text("{not json")
    payload = tmp_path / "step_00000002" / "model_optim.pt"
    payload.write_bytes(payload.read_bytes()[:-10])
    with caplog.at_level("WARNING", logger="trmoe"):
        assert store.newest_good().step == 1
    assert "step_00000003 is unusable" in caplog.text and "no readable meta.json" in caplog.text
    assert "step_00000002 is unusable" in caplog.text and "truncated" in caplog.text
    # leftovers of interrupted saves are never read, and the next save removes them
    (tmp_path / ".step_00000009.tmp").mkdir()
    (tmp_path / ".step_00000001.deleting").mkdir()
    store.save(4, model=model, optimizer=optimizer, local_state={}, meta={})
    assert not any(p.name.startswith(".step_") for p in tmp_path.iterdir())
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        resolve_checkpoint(tmp_path / "nothing")


# meta.json that is valid JSON of another shape (a hand edit, another tool's file), and what verify says
OTHER_SHAPES = [
    pytest.param(lambda meta: None, "is not a trmoe checkpoint", id="null"),
    pytest.param(lambda meta: [], "is not a trmoe checkpoint", id="list"),
    pytest.param(lambda meta: {**meta, "files": 5}, "files = 5; expected an object", id="files"),
    pytest.param(lambda meta: {**meta, "files": {"model_optim.pt": 5}}, "files = ", id="file-entry"),
    pytest.param(lambda meta: {k: v for k, v in meta.items() if k != "step"}, "has no step", id="no-step"),
    pytest.param(lambda meta: {**meta, "step": "3"}, 'step = "3"; expected an integer', id="step"),
    pytest.param(lambda meta: {**meta, "metrics": []}, r"metrics = \[\]; expected an object", id="metrics"),
    pytest.param(lambda meta: {**meta, "config": "x"}, "config = ", id="config"),
    pytest.param(lambda meta: {**meta, "eval_loss": None}, "eval_loss = null; expected a number", id="loss"),
]


@pytest.mark.parametrize("edit,reason", OTHER_SHAPES)
def test_a_meta_json_of_another_shape_is_reported_and_skipped(tmp_path, caplog, edit, reason):
    model, optimizer = _model_and_optimizer()
    store = CheckpointStore(tmp_path, keep_last=0)
    meta = {"config": {}, "eval_loss": 1.0}
    for step in (1, 2):
        store.save(step, model=model, optimizer=optimizer, local_state={}, meta=meta)
    meta_file = tmp_path / "step_00000002" / "meta.json"
    meta_file.write_text(json.dumps(edit(json.loads(meta_file.read_text()))))
    with pytest.raises(CheckpointError, match=reason):
        store.verify(tmp_path / "step_00000002")
    with caplog.at_level("WARNING", logger="trmoe"):
        assert store.newest_good().step == 1
    assert "step_00000002 is unusable" in caplog.text


def test_a_latest_pointer_that_is_not_text_is_no_pointer(tmp_path):
    model, optimizer = _model_and_optimizer()
    store = CheckpointStore(tmp_path)
    store.save(1, model=model, optimizer=optimizer, local_state={}, meta={})
    (tmp_path / "latest").write_bytes(b"\xff\xfe\x00x\n")
    assert read_pointer(tmp_path) is None
    assert resolve_checkpoint(tmp_path) == tmp_path / "step_00000001"


def test_a_save_whose_latest_cannot_be_written_is_complete_and_says_so(tmp_path, caplog):
    """`latest` replaced by a directory mid-run (the launch refuses it: test_launch.py): the checkpoint is
    complete and verifies, so the save is no failure and never names itself as "still" the newest complete
    one (151d5ed: "checkpoint at step 4 failed: ...; the newest complete checkpoint is still step_00000004").
    A `latest` file that cannot be replaced is removed rather than left naming an older checkpoint."""
    model, optimizer = _model_and_optimizer()
    ckpts = tmp_path / "checkpoints"
    store = CheckpointStore(ckpts, keep_last=0)

    def state():
        return {"model": model, "optimizer": optimizer, "local_state": {}, "meta": {}}

    assert store.try_save(2, state)
    (ckpts / "latest").unlink()
    (ckpts / "latest").mkdir()
    with caplog.at_level("WARNING", logger="trmoe"):
        assert store.try_save(4, state)
    assert "failed" not in caplog.text and "still" not in caplog.text, caplog.text
    assert f"checkpoint step_00000004 is complete, but {ckpts / 'latest'} could not be made to" in caplog.text
    assert store.last_saved == 4 and store.newest_good().step == 4
    assert (ckpts / "latest").is_dir() and resolve_checkpoint(ckpts) == ckpts / "step_00000004"

    (ckpts / "latest").rmdir()
    (ckpts / "latest").write_text("step_00000004\n")
    (ckpts / ".latest.partial").mkdir()  # the pointer's temporary name taken: `latest` cannot be replaced
    assert store.try_save(6, state)
    assert not (ckpts / "latest").exists() and resolve_checkpoint(ckpts) == ckpts / "step_00000006"

    # checkpoints/ replaced by a file: a failed save, which names no checkpoint as the newest
    shutil.rmtree(ckpts)
    ckpts.write_text("not a directory")
    caplog.clear()
    with caplog.at_level("ERROR", logger="trmoe"):
        assert not store.try_save(8, state)
    assert store.last_failure.endswith("; the newest complete checkpoint is none"), store.last_failure


@pytest.mark.parametrize("fmt", ["torch", "dcp"])
def test_model_shapes_are_read_without_loading_the_tensors(tmp_path, fmt):
    from trmoe.run.checkpoint import model_shapes

    model, optimizer = _model_and_optimizer()
    model.register_buffer("table", torch.zeros(3, dtype=torch.int32))
    store = CheckpointStore(tmp_path, format=fmt)
    store.save(1, model=model, optimizer=optimizer, local_state={}, meta={})
    info = store.verify(tmp_path / "step_00000001")
    assert model_shapes(info) == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if fmt == "torch":  # a payload that verifies but holds no model state
        torch.save({"weights": torch.zeros(2)}, info.path / "model_optim.pt")
        with pytest.raises(CheckpointError, match="no readable model state"):
            model_shapes(info)


def test_dcp_format_run_resumes_bit_exact_and_equals_the_torch_format(tmp_path):
    """checkpoint.format=dcp in one process (torch.distributed.checkpoint without a process group)."""
    base = [
        "data=random",
        "model.vocab_size=512",
        "trainer.micro_batch=4",
        "trainer.seq_len=64",
        "hardware=cpu",
        "hardware.threads=1",
        "run.progress=log",
        "trainer.steps=4",
        "checkpoint.every_steps=2",
        "trainer.log_every=1",
    ]
    threads = torch.get_num_threads()
    try:
        train(compose_config(*base), tmp_path / "torch")
        run_dir = tmp_path / "dcp"
        train(compose_config(*base, "checkpoint.format=dcp"), run_dir)
        assert (
            json.loads((run_dir / "checkpoints" / "step_00000004" / "meta.json").read_text())["format"]
            == "dcp"
        )
        shutil.rmtree(run_dir / "checkpoints" / "step_00000004")
        train(compose_config(*base, "checkpoint.format=dcp"), run_dir)  # resumes from step 2 (DCP load)
    finally:
        torch.set_num_threads(threads)
    a, b = load_checkpoint(run_dir), load_checkpoint(tmp_path / "torch")
    assert a["step"] == b["step"] == 4
    for key in b["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    with open(run_dir / "metrics.csv") as fa, open(tmp_path / "torch" / "metrics.csv") as fb:
        cut = lambda line: line.split(",")[:13]  # noqa: E731  (the loss columns, before tok_s)
        assert [cut(x) for x in fa] == [cut(x) for x in fb]


def _join(rank: int, world: int, out: str) -> None:
    """One of `world` gloo ranks spawned by a test, meeting through a file in `out`."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{out}/rendezvous",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )


def _dcp_case(rank: int, world: int, out: Path) -> None:
    model, optimizer = _model_and_optimizer(steps=2)  # identical on both ranks (replicated, as under DDP)
    store = CheckpointStore(out / "ckpt", keep_last=1, format="dcp", rank=rank, world_size=world)
    for step in (1, 2):
        store.save(step, model=model, optimizer=optimizer, local_state={"rank": rank}, meta={"tokens": step})
    info = store.verify(out / "ckpt" / "step_00000002")
    fresh, fresh_opt = _model_and_optimizer(seed=rank + 10, steps=1)
    local = store.load(info, model=fresh, optimizer=fresh_opt)
    _assert_same(model, fresh, optimizer, fresh_opt)
    torch.save({"local": local, "meta": info.meta}, out / f"rank{rank}.pt")


def _failing_rank_case(rank: int, world: int, out: Path, failing: int) -> None:
    """Rank `failing` cannot write its rank file (a full disk on its node) at step 2."""
    from trmoe.run import checkpoint

    real_write = checkpoint._write_durable

    def full_disk(path, payload):
        if rank == failing and Path(path).name.startswith("rank_") and "00000002" in str(path):
            raise OSError(28, "No space left on device")
        return real_write(path, payload)

    checkpoint._write_durable = full_disk
    try:
        model, optimizer = _model_and_optimizer(steps=2)
        store = CheckpointStore(out / "ckpt", keep_last=0, format="dcp", rank=rank, world_size=world)
        store.save(1, model=model, optimizer=optimizer, local_state={}, meta={})
        try:
            store.save(2, model=model, optimizer=optimizer, local_state={}, meta={})
            outcome = "saved"
        except OSError as e:
            outcome = str(e)
        store.save(3, model=model, optimizer=optimizer, local_state={}, meta={})  # and the run goes on
        (out / f"outcome{rank}.txt").write_text(outcome)
    finally:
        checkpoint._write_durable = real_write


def _gloo_worker(rank: int, world: int, out: str) -> None:
    """The two-rank cases one after another in one process group (one spawn for all: each rank pays the
    imports once), each in its own directory."""
    _join(rank, world, out)
    try:
        _dcp_case(rank, world, Path(out) / "dcp")
        for failing in (0, 1):
            _failing_rank_case(rank, world, Path(out) / f"fail{failing}", failing)
    finally:
        distributed.shutdown()


@pytest.fixture(scope="module")
def gloo_cases(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gloo")
    for case in ("dcp", "fail0", "fail1"):
        (out / case).mkdir()
    spawn_ranks(_gloo_worker, (2, str(out)))
    return out


@pytest.mark.subprocess
def test_dcp_two_gloo_ranks_save_and_load(gloo_cases):
    """Every rank calls save/load; each writes its own files, rank 0 the metadata, the rename, `latest`
    and the pruning; each rank gets its own train state back."""
    out = gloo_cases / "dcp"
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["local"] for r in results] == [{"rank": 0}, {"rank": 1}]
    meta = results[0]["meta"]
    assert meta["world_size"] == 2 and meta["step"] == 2
    assert {"rank_00000.pt", "rank_00001.pt", ".metadata"} <= set(meta["files"])
    assert [p.name for p in (out / "ckpt").iterdir() if p.name.startswith("step_")] == ["step_00000002"]
    assert read_pointer(out / "ckpt") == "step_00000002"


@pytest.mark.subprocess
@pytest.mark.parametrize("failing", [0, 1])
def test_a_save_that_fails_on_one_rank_fails_on_every_rank(gloo_cases, failing):
    """Rank 0 alone commits a checkpoint: had the others gone on (or rank 0, with another rank's file
    missing), one side would wait forever in the next collective. Every rank raises, the step is not
    committed, the previous checkpoint stays and the next save works."""
    out = gloo_cases / f"fail{failing}"
    outcomes = [(out / f"outcome{r}.txt").read_text() for r in range(2)]
    assert "No space left on device" in outcomes[failing]
    assert "failed on another rank" in outcomes[1 - failing]
    steps = sorted(p.name for p in (out / "ckpt").iterdir() if p.name.startswith("step_"))
    assert steps == ["step_00000001", "step_00000003"]


def test_a_dcp_checkpoint_before_the_first_step_leaves_the_optimizer_empty(tmp_path):
    """torch's get_state_dict initialises an empty optimizer state with a zero-lr step (step counts 1): a
    step-0 checkpoint (spike_policy=rollback saves one) made the first real AdamW update another one."""
    model, optimizer = _model_and_optimizer(steps=0)
    store = CheckpointStore(tmp_path, format="dcp")
    store.save(0, model=model, optimizer=optimizer, local_state={}, meta={})
    assert not optimizer.state
    info = store.verify(tmp_path / "step_00000000")
    assert info.meta["optimizer_empty"] is True
    fresh, fresh_opt = _model_and_optimizer(seed=1, steps=0)
    store.load(info, model=fresh, optimizer=fresh_opt)
    assert not fresh_opt.state  # loaded as saved: before any step


def test_every_flipped_bit_of_meta_json_is_caught_and_the_step_must_match_the_name(tmp_path):
    """meta.json holds the checksums of the other files and the step a resume starts from: one flipped bit
    anywhere in it makes the checkpoint unusable (unless it parses to the same content, e.g. 'e' -> 'E' in a
    number), and a valid meta.json under another step's name (a copied directory) too."""
    model, optimizer = _model_and_optimizer()
    store = CheckpointStore(tmp_path, keep_last=0)
    store.save(7, model=model, optimizer=optimizer, local_state={}, meta={"eval_loss": 2.5, "config": {}})
    path = tmp_path / "step_00000007"
    original = (path / "meta.json").read_bytes()
    meta = json.loads(original)
    assert meta["step"] == 7 and meta["format_version"] == 2 and "meta_crc32" in meta
    missed = []
    for i in range(len(original)):
        for bit in range(8):
            flipped = bytearray(original)
            flipped[i] ^= 1 << bit
            (path / "meta.json").write_bytes(bytes(flipped))
            try:
                info = store.verify(path)
            except CheckpointError:
                continue
            if info.meta != meta:
                missed.append((i, bit))
    assert missed == []
    (path / "meta.json").write_bytes(original)
    assert store.verify(path).step == 7
    shutil.copytree(path, tmp_path / "step_00000008")
    with pytest.raises(CheckpointError, match="meta.json says step 7, the directory's name 8"):
        store.verify(tmp_path / "step_00000008")
    assert store.newest_good().step == 7
