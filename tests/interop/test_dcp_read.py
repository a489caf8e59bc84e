"""moetrain.interop.dcp_read: boxes of tensors out of a torch.distributed.checkpoint directory in one process.

Single-process saves (plain tensors, nested keys, dtype casts, edge boxes, errors, which chunks are read and how
many are alive at once) and a 4-rank gloo save of DTensors with uneven shards on a (2, 2) and a 1-D mesh of 4, read
back in this process without a process group (``-m dist``)."""

from __future__ import annotations

import os
import tempfile
import time
import warnings
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemReader

from moetrain.interop.dcp_read import (BoxRequest, DCPKeyError, DCPReadError, TensorSpec, checkpoint_tensors,
                                       read_boxes, read_tensor)


def _save_single(state_dict: dict, path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... save in a single process"
        dcp.save(state_dict, checkpoint_id=str(path))
    return path


class _ReadLog:
    """Patches FileSystemReader.read_data to record every ReadItem executed: (key, saved chunk offsets)."""

    def __init__(self, monkeypatch):
        self.items: list[tuple[str, tuple[int, ...]]] = []
        self.calls = 0
        original = FileSystemReader.read_data

        def read_data(reader, plan, planner):
            self.calls += 1
            self.items += [(i.storage_index.fqn, tuple(i.storage_index.offset)) for i in plan.items]
            return original(reader, plan, planner)

        monkeypatch.setattr(FileSystemReader, "read_data", read_data)


# ----------------------------------------------------------------------------------------------------------------
# Single process
# ----------------------------------------------------------------------------------------------------------------

def _single_tensors() -> dict:
    return {
        "model": {"x": torch.arange(3 * 4 * 5, dtype=torch.float32).reshape(3, 4, 5) / 7,
                  "layers": {"0": {"w": torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8) - 20}},
                  "scalar": torch.tensor(2.5, dtype=torch.float64)},
        "bf": torch.linspace(-3, 3, 24).reshape(4, 6).to(torch.bfloat16),
        "ints": torch.arange(10, dtype=torch.int64) * 3,
    }


@pytest.fixture(scope="module")
def single_ckpt(tmp_path_factory) -> Path:
    sd = _single_tensors()
    sd["step"] = 17          # non-tensor entries are stored as bytes
    sd["extra"] = {"name": "run"}
    return _save_single(sd, tmp_path_factory.mktemp("single") / "ckpt")


def _flat() -> dict[str, torch.Tensor]:
    t = _single_tensors()
    return {"model.x": t["model"]["x"], "model.layers.0.w": t["model"]["layers"]["0"]["w"],
            "model.scalar": t["model"]["scalar"], "bf": t["bf"], "ints": t["ints"]}


def test_checkpoint_tensors_lists_flattened_tensor_keys_only(single_ckpt):
    specs = checkpoint_tensors(single_ckpt)
    assert specs == {k: TensorSpec(tuple(v.shape), v.dtype) for k, v in sorted(_flat().items())}
    assert list(specs) == sorted(specs)
    assert "step" not in specs and "extra.name" not in specs


def test_whole_tensors(single_ckpt):
    for key, want in _flat().items():
        got = read_tensor(single_ckpt, key)
        assert got.dtype == want.dtype and torch.equal(got, want), key


BOXES = [
    ("model.x", (0, 0, 0), (3, 4, 5)),      # everything
    ("model.x", (1, 2, 3), (2, 2, 2)),      # interior, crosses every dim's boundary between rows/cols
    ("model.x", (2, 3, 4), (1, 1, 1)),      # last element
    ("model.x", (0, 3, 0), (3, 1, 5)),      # a last-row slab across the outer dim
    ("model.x", (1, 0, 0), (1, 4, 5)),      # one middle slab
    ("model.layers.0.w", (5, 0), (1, 8)),   # last row
    ("model.layers.0.w", (0, 7), (6, 1)),   # last column (strided in storage)
    ("model.layers.0.w", (2, 3), (3, 4)),
    ("model.scalar", (), ()),               # 0-d
    ("ints", (9,), (1,)),
    ("ints", (4,), (0,)),                   # empty box
]


@pytest.mark.parametrize("key,offsets,sizes", BOXES)
def test_boxes_equal_slices(single_ckpt, key, offsets, sizes):
    want = _flat()[key][tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
    got = read_tensor(single_ckpt, key, offsets, sizes)
    assert got.shape == want.shape and torch.equal(got, want)


def test_read_tensor_defaults_sizes_to_rest_of_tensor(single_ckpt):
    assert torch.equal(read_tensor(single_ckpt, "model.layers.0.w", (4, 5)), _flat()["model.layers.0.w"][4:, 5:])


def test_many_boxes_same_key_one_load_call(single_ckpt, monkeypatch):
    x, w = _flat()["model.x"], _flat()["model.layers.0.w"]
    loads = []
    real_load = dcp.load
    monkeypatch.setattr(dcp, "load", lambda *a, **k: (loads.append(1), real_load(*a, **k))[1])
    boxes = [((0, 0, 0), (1, 2, 3)), ((1, 1, 1), (2, 3, 4)), ((0, 0, 0), (1, 2, 3)), ((2, 0, 4), (1, 4, 1))]
    reqs = [BoxRequest("model.x", o, torch.full(s, -1.0)) for o, s in boxes]
    reqs.append(BoxRequest("model.layers.0.w", (1, 2), torch.full((4, 5), -1.0)))
    read_boxes(single_ckpt, reqs)
    assert len(loads) == 1
    for (o, s), r in zip(boxes, reqs[:-1]):
        assert torch.equal(r.dest, x[o[0]:o[0] + s[0], o[1]:o[1] + s[1], o[2]:o[2] + s[2]])
    assert torch.equal(reqs[-1].dest, w[1:5, 2:7])


def test_dtype_cast_on_copy(single_ckpt):
    x = _flat()["model.x"]
    got = read_tensor(single_ckpt, "model.x", (1, 1, 0), (2, 3, 5), dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, x[1:, 1:].to(torch.bfloat16))
    dest = torch.empty(2, 6, dtype=torch.float32)                                     # bf16 stored -> fp32
    read_boxes(single_ckpt, [BoxRequest("bf", (2, 0), dest)])
    assert torch.equal(dest, _flat()["bf"][2:].float())
    dest64 = torch.empty(3, dtype=torch.float64)                                      # int64 stored -> fp64
    read_boxes(single_ckpt, [BoxRequest("ints", (1,), dest64)])
    assert torch.equal(dest64, torch.tensor([3.0, 6.0, 9.0], dtype=torch.float64))


def test_dest_may_be_a_strided_view(single_ckpt):
    w = _flat()["model.layers.0.w"]
    big = torch.zeros(8, 10)
    read_boxes(single_ckpt, [BoxRequest("model.layers.0.w", (0, 0), big[1:7, 2:10]),
                             BoxRequest("model.layers.0.w", (0, 0), big.t()[0:2, 0:1].t())])  # (1, 2), strided
    assert torch.equal(big[1:7, 2:10], w) and torch.equal(big[0, 0:2], w[0, 0:2])
    assert big[7].abs().sum() == 0 and big[1:7, :2].abs().sum() == 0


def test_only_the_requested_keys_chunks_are_read(single_ckpt, monkeypatch):
    log = _ReadLog(monkeypatch)
    read_tensor(single_ckpt, "model.layers.0.w", (1, 1), (2, 2))
    assert log.items == [("model.layers.0.w", (0, 0))]
    log.items.clear()
    read_boxes(single_ckpt, [BoxRequest("ints", (0,), torch.empty(2)), BoxRequest("ints", (5,), torch.empty(3))])
    assert log.items == [("ints", (0,)), ("ints", (0,))]   # one ReadItem per (box, overlapping chunk)


def test_one_saved_chunk_alive_at_a_time(tmp_path, monkeypatch):
    """Every torch.load DCP does for a ReadItem finds the previously loaded chunk already freed (the stock
    FileSystemReader keeps it alive until the next load returns)."""
    sd = {f"k{i}": torch.full((1000,), float(i)) for i in range(5)}
    ckpt = _save_single(sd, tmp_path / "ckpt")
    loaded: list[weakref.ref] = []
    alive_at_load: list[int] = []
    real = torch.load

    def counting_load(*a, **k):
        alive_at_load.append(sum(r() is not None for r in loaded))
        t = real(*a, **k)
        loaded.append(weakref.ref(t))
        return t

    monkeypatch.setattr(torch, "load", counting_load)
    dests = [torch.empty(1000) for _ in range(5)]
    read_boxes(ckpt, [BoxRequest(f"k{i}", (0,), d) for i, d in enumerate(dests)])
    assert len(alive_at_load) == 5 and max(alive_at_load) == 0, alive_at_load
    assert all(torch.equal(d, sd[f"k{i}"]) for i, d in enumerate(dests))
    # The weakref probe does detect a live chunk: the stock reader shows one.
    loaded.clear(), alive_at_load.clear()
    sd2 = {f"k{i}": torch.empty(1000) for i in range(5)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd2, checkpoint_id=str(ckpt), no_dist=True)
    assert max(alive_at_load) == 1


# -- errors -------------------------------------------------------------------------------------------------------

def test_unknown_key_names_it_and_close_keys(single_ckpt):
    with pytest.raises(DCPKeyError) as ei:
        read_tensor(single_ckpt, "model.layers.0.ww")
    msg = str(ei.value)
    assert "'model.layers.0.ww'" in msg and "'model.layers.0.w'" in msg
    assert isinstance(ei.value, KeyError) and isinstance(ei.value, ValueError)


def test_close_keys_at_most_five(tmp_path):
    ckpt = _save_single({"layers": {str(i): {"w": torch.zeros(1)} for i in range(12)}}, tmp_path / "c")
    with pytest.raises(KeyError) as ei:
        read_boxes(ckpt, [BoxRequest("layers.1.v", (0,), torch.empty(1))])
    assert 1 <= str(ei.value).count("'layers.") - 1 <= 5, str(ei.value)


def test_non_tensor_key(single_ckpt):
    with pytest.raises(DCPReadError, match="'step' is a non-tensor"):
        read_tensor(single_ckpt, "step")


@pytest.mark.parametrize("offsets,sizes", [((0, 0), (7, 8)), ((0, 7), (6, 2)), ((-1, 0), (2, 2)), ((6, 0), (1, 1)),
                                           ((0, 0, 0), (1, 1, 1)), ((0,), (6,))])
def test_box_outside_stored_shape(single_ckpt, offsets, sizes):
    with pytest.raises(ValueError) as ei:
        read_boxes(single_ckpt, [BoxRequest("model.layers.0.w", offsets, torch.empty(sizes))])
    msg = str(ei.value)
    assert "'model.layers.0.w'" in msg and "(6, 8)" in msg and str(tuple(offsets)) in msg and str(tuple(sizes)) in msg


def test_read_tensor_box_outside(single_ckpt):
    with pytest.raises(DCPReadError, match=r"outside the stored shape \(10,\)"):
        read_tensor(single_ckpt, "ints", (11,))


def test_requests_validated_before_anything_is_read(single_ckpt, monkeypatch):
    log = _ReadLog(monkeypatch)
    good = torch.full((2, 2), -1.0)
    with pytest.raises(DCPKeyError):
        read_boxes(single_ckpt, [BoxRequest("model.layers.0.w", (0, 0), good),
                                 BoxRequest("nope", (0,), torch.empty(1))])
    assert log.calls == 0 and (good == -1).all()


def test_not_a_checkpoint_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty.*no \.metadata"):
        checkpoint_tensors(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="missing"):
        read_tensor(tmp_path / "missing", "x")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(DCPReadError, match="bad"):
        checkpoint_tensors(tmp_path / "bad")


def test_missing_data_file_raises_the_os_error(tmp_path):
    ckpt = _save_single({"w": torch.zeros(3)}, tmp_path / "c")
    for f in ckpt.glob("*.distcp"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="distcp"):  # DCP's CheckpointException unwrapped
        read_tensor(ckpt, "w")


def test_empty_request_list_reads_nothing(single_ckpt, monkeypatch):
    log = _ReadLog(monkeypatch)
    read_boxes(single_ckpt, [])
    assert log.calls == 0


# ----------------------------------------------------------------------------------------------------------------
# 4 gloo ranks save DTensors; this process (no process group) reads them
# ----------------------------------------------------------------------------------------------------------------

# key -> (shape, dtype, mesh ("2d" = (2, 2), "1d" = (4,), None = plain tensor), placements, saved chunks as
# (offsets, sizes) in global coordinates: what DCP must have written, checked against the metadata)
DIST_TENSORS = {
    "model.a": ((7, 5), torch.float32, "2d", ("S1", "S0"),
                {((0, 0), (4, 3)), ((4, 0), (3, 3)), ((0, 3), (4, 2)), ((4, 3), (3, 2))}),
    "model.b": ((9, 6), torch.float32, "2d", ("S0", "S0"),
                {((0, 0), (3, 6)), ((3, 0), (2, 6)), ((5, 0), (2, 6)), ((7, 0), (2, 6))}),
    "model.c": ((6, 10), torch.float32, "2d", ("R", "S1"), {((0, 0), (6, 5)), ((0, 5), (6, 5))}),
    "optim.d": ((10, 3), torch.float32, "1d", ("S0",),
                {((0, 0), (3, 3)), ((3, 0), (3, 3)), ((6, 0), (3, 3)), ((9, 0), (1, 3))}),
    "optim.h": ((2, 3, 6), torch.bfloat16, "1d", ("S2",),                 # 6 over 4 ranks: 2, 2, 2, 0
                {((0, 0, 0), (2, 3, 2)), ((0, 0, 2), (2, 3, 2)), ((0, 0, 4), (2, 3, 2))}),
    "extra.plain": ((3, 4), torch.float32, None, (), {((0, 0), (3, 4))}),
}


def _full(key: str) -> torch.Tensor:
    shape, dtype = DIST_TENSORS[key][:2]
    base = 0 if dtype == torch.bfloat16 else 1000 * sorted(DIST_TENSORS).index(key)  # bf16: exact up to 256
    return (torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + base).to(dtype)


def _placements(codes):
    from torch.distributed.tensor import Replicate, Shard
    return tuple(Replicate() if c == "R" else Shard(int(c[1:])) for c in codes)


# Boxes each rank reads in the workers while its process group is up (a different number of calls per rank: with
# any collective inside read_boxes this would hang).
def _rank_boxes(rank: int) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    return [("model.a", (rank, 0), (3, 5)), ("optim.d", (rank * 2, 1), (2, 2))][: 1 + rank % 2]


def _dist_worker(rank: int, world: int, store_path: str, ckpt: str, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        meshes = {"2d": init_device_mesh("cpu", (2, 2)), "1d": init_device_mesh("cpu", (4,))}
        sd: dict = {"model": {}, "optim": {}, "extra": {}}
        for key, (_, _, mesh, placements, _) in DIST_TENSORS.items():
            group, name = key.split(".")
            t = _full(key)
            sd[group][name] = t if mesh is None else distribute_tensor(t, meshes[mesh], _placements(placements))
        sd["step"] = 42
        dcp.save(sd, checkpoint_id=ckpt)
        dist.barrier()
        got = {}
        for i, (key, offsets, sizes) in enumerate(_rank_boxes(rank)):
            got[i] = read_tensor(ckpt, key, offsets, sizes)
        torch.save(got, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def dist_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    ckpt, out = root / "ckpt", root / "out"
    out.mkdir()
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.start_processes(_dist_worker, args=(4, os.path.join(d, "store"), str(ckpt), str(out)), nprocs=4,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + 180
        try:
            while not ctx.join(timeout=1):  # raises ProcessRaisedException with the rank's traceback
                if time.monotonic() > deadline:
                    raise TimeoutError("DCP save on 4 gloo ranks did not finish in 180 s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
    return ckpt, [torch.load(out / f"rank{r}.pt") for r in range(4)]


@pytest.mark.dist
def test_dist_saved_chunks_are_the_expected_shards(dist_ckpt):
    md = FileSystemReader(dist_ckpt[0]).read_metadata()
    for key, (_, _, _, _, chunks) in DIST_TENSORS.items():
        saved = {(tuple(c.offsets), tuple(c.sizes)) for c in md.state_dict_metadata[key].chunks
                 if torch.Size(c.sizes).numel() > 0}
        assert saved == chunks, key


@pytest.mark.dist
def test_dist_checkpoint_read_in_one_process(dist_ckpt):
    ckpt = dist_ckpt[0]
    assert not dist.is_initialized()
    assert checkpoint_tensors(ckpt) == {k: TensorSpec(v[0], v[1]) for k, v in sorted(DIST_TENSORS.items())}
    for key in DIST_TENSORS:
        assert torch.equal(read_tensor(ckpt, key), _full(key)), key
    boxes = [("model.a", (2, 1), (4, 3)),          # all four (Shard(1), Shard(0)) chunks
             ("model.a", (0, 2), (7, 2)),          # both column blocks, all rows
             ("model.a", (6, 4), (1, 1)),          # corner element
             ("model.b", (2, 1), (6, 4)),          # nested Shard(0), Shard(0): three chunks
             ("model.c", (1, 3), (5, 6)),          # Replicate x Shard(1)
             ("optim.d", (2, 0), (8, 3)),          # ranks 0..3 of the 1-D mesh, uneven last chunk
             ("optim.d", (9, 2), (1, 1)),
             ("optim.h", (1, 1, 1), (1, 2, 5)),    # bf16, across three chunks of the last dim
             ("extra.plain", (1, 1), (2, 3))]
    reqs = [BoxRequest(k, o, torch.full(s, -7.0, dtype=DIST_TENSORS[k][1])) for k, o, s in boxes]
    reqs.append(BoxRequest("model.a", (1, 1), torch.empty(5, 4, dtype=torch.bfloat16)))   # cast fp32 -> bf16
    reqs.append(BoxRequest("optim.h", (0, 0, 0), torch.empty(2, 3, 6, dtype=torch.float64)))
    read_boxes(ckpt, reqs)
    for r in reqs:
        want = _full(r.key)[tuple(slice(o, o + s) for o, s in zip(r.offsets, r.dest.shape))].to(r.dest.dtype)
        assert torch.equal(r.dest, want), (r.key, r.offsets, tuple(r.dest.shape))


@pytest.mark.dist
def test_dist_box_reads_only_overlapping_chunks(dist_ckpt, monkeypatch):
    ckpt = dist_ckpt[0]
    log = _ReadLog(monkeypatch)
    read_tensor(ckpt, "model.a", (5, 1), (2, 2))          # inside the chunk at (4, 0)
    assert log.items == [("model.a", (4, 0))]
    log.items.clear()
    read_tensor(ckpt, "optim.d", (4, 0), (2, 3))          # inside rank 1's rows [3, 6)
    assert log.items == [("optim.d", (3, 0))]
    log.items.clear()
    read_tensor(ckpt, "optim.d", (5, 1), (2, 1))          # rows 5, 6: two chunks
    assert sorted(log.items) == [("optim.d", (3, 0)), ("optim.d", (6, 0))]
    log.items.clear()
    read_tensor(ckpt, "model.a", (3, 2), (2, 2))          # the 2x2 around the centre: all four
    assert len(log.items) == 4 and {k for k, _ in log.items} == {"model.a"}


@pytest.mark.dist
def test_dist_read_while_a_process_group_is_up(dist_ckpt):
    for rank, got in enumerate(dist_ckpt[1]):
        boxes = _rank_boxes(rank)
        assert len(got) == len(boxes)
        for i, (key, offsets, sizes) in enumerate(boxes):
            assert torch.equal(got[i], _full(key)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))])
