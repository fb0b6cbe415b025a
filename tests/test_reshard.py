"""soapjax.cost.reshard: the collectives of a resharding, ideal and as XLA compiles them.

One `Resharder` per mesh for the whole module, prefetched once, so the jax import of the
compiling subprocess is paid once per mesh.
"""

from __future__ import annotations

import json
import random
import shutil
import time

import jax
import pytest
from jax.sharding import PartitionSpec as P

from soapjax.cost import reshard as rs
from soapjax.cost.reshard import Collective, Resharder, ReshardError
from soapjax.strategy.space import MeshShape

MESH = MeshShape(("data", "model"), (2, 4))
SHAPE = (64, 1024)  # f32: 256 KiB in all, 64 KiB per model shard
KiB = 1024.0

# (id, src, dst, partial, what XLA does in jax 0.10.2, what the ideal model says)
CASES = [
    pytest.param(
        P("model", None),
        P(None, "model"),
        (),
        (Collective("all_to_all", 64 * KiB, ("model",)),),
        (Collective("all_to_all", 64 * KiB, ("model",)),),
        id="same-axis-moves-dims",
    ),
    pytest.param(
        P("data", None),
        P(None, "model"),
        (),
        # "Involuntary full rematerialization": the WHOLE f32[64,1024] is gathered.
        (Collective("all_gather", 256 * KiB, ("data",)),),
        (Collective("all_gather", 64 * KiB, ("data",)),),
        id="different-axes-full-gather",
    ),
    pytest.param(
        P("model", None),
        P("data", None),
        (),
        (
            Collective("collective_permute", 64 * KiB, ("data", "model")),
            Collective("all_gather", 128 * KiB, ("model",), group_size=2),
        ),
        (Collective("all_gather", 256 * KiB, ("model",)),),
        id="permute-then-gather",
    ),
    pytest.param(P("data", None), P("data", "model"), (), (), (), id="local-slice"),
    pytest.param(
        P("data", None),
        P("data", None),
        ("model",),
        (Collective("all_reduce", 128 * KiB, ("model",)),),
        (Collective("all_reduce", 128 * KiB, ("model",)),),
        id="partial-all-reduce",
    ),
    pytest.param(
        P("data", None),
        P("data", "model"),
        ("model",),
        (Collective("reduce_scatter", 128 * KiB, ("model",)),),
        (Collective("reduce_scatter", 128 * KiB, ("model",)),),
        id="partial-reduce-scatter",
    ),
    pytest.param(
        P(None, None),
        P(("data", "model"), None),
        ("model",),
        # XLA reduces the whole tensor, then slices 1/8: no reduce-scatter.
        (Collective("all_reduce", 256 * KiB, ("model",)),),
        (Collective("reduce_scatter", 128 * KiB, ("model",)),),
        id="partial-sliced-finer-than-the-group",
    ),
]


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    return tmp_path_factory.mktemp("soapjax-cache")


@pytest.fixture(scope="module")
def prefetched(cache_root):
    r = Resharder(MESH, "xla", cache_dir=cache_root)
    t = time.perf_counter()
    compiled = r.prefetch([(SHAPE, "float32", *p.values[:3]) for p in CASES])
    yield r, compiled, r.stats, time.perf_counter() - t
    r.close()


@pytest.fixture
def resharder(prefetched):
    return prefetched[0]


@pytest.mark.parametrize("src, dst, partial, xla, ideal", CASES)
def test_design_cases(resharder, src, dst, partial, xla, ideal):
    got = resharder.lookup(SHAPE, "float32", src, dst, partial=partial)
    assert got.source == "xla"
    assert got.collectives == xla
    assert rs.ideal_collectives(SHAPE, "float32", src, dst, MESH, partial=partial) == ideal


def test_xla_and_ideal_differ_where_design_says(resharder):
    differ = [p.id for p in CASES if p.values[3] != p.values[4]]
    assert differ == [
        "different-axes-full-gather",
        "permute-then-gather",
        "partial-sliced-finer-than-the-group",
    ]


def test_replicates_whole_names_xlas_replicate_then_slice(resharder):
    """``P('data', None) -> P(None, 'model')``: XLA gathers the whole tensor and slices it
    (the design case above), the ideal model slices first; a replicated destination is
    gathered whole by any model and is not the pattern."""
    src, dst = P("data", None), P(None, "model")
    assert resharder.replicates_whole(SHAPE, "float32", src, dst)
    assert not Resharder(MESH).replicates_whole(SHAPE, "float32", src, dst)
    assert not resharder.replicates_whole(SHAPE, "float32", P("model", None), P())


def test_prefetch_was_one_subprocess_batch(prefetched):
    _, compiled, stats, seconds = prefetched
    assert compiled == len(CASES)
    assert stats == {
        "requests": 1,
        "worker_starts": 1,
        "compiled": len(CASES),
        "disk_hits": 0,
        "fallbacks": 0,
    }
    assert seconds < 30  # a jax import and one compiled program


def test_memoised_hit_is_a_dict_lookup(resharder):
    src, dst = (("model",), ()), ((), ("model",))
    first = resharder.reshard(SHAPE, "float32", src, dst)
    n = 20000
    t = time.perf_counter()
    for _ in range(n):
        again = resharder.reshard(SHAPE, "float32", src, dst)
    per_call = (time.perf_counter() - t) / n
    assert again is first
    assert per_call < 10e-6  # ~0.3 us here; generous for a loaded machine


def test_bfloat16_bytes_are_bfloat16(resharder):
    # The CPU backend would promote a bf16 collective to f32; compiled as u16 it keeps 2 bytes.
    got = resharder.reshard(SHAPE, jax.numpy.bfloat16, P("data", None), P(None, "model"))
    assert got == (Collective("all_gather", 128 * KiB, ("data",)),)


def test_second_resharder_reads_the_disk_cache(resharder, cache_root):
    with Resharder(MESH, "xla", cache_dir=cache_root) as again:
        for p in CASES:
            src, dst, partial, xla, _ = p.values
            assert again.lookup(SHAPE, "float32", src, dst, partial=partial).collectives == xla
        assert again.stats["requests"] == 0 and again.stats["worker_starts"] == 0
        assert again.stats["disk_hits"] == len(CASES)


def test_same_mesh_shape_other_names_shares_the_cache(resharder, cache_root):
    with Resharder(MeshShape(("dp", "tp"), (2, 4)), "xla", cache_dir=cache_root) as other:
        got = other.reshard(SHAPE, "float32", P("tp", None), P(None, "tp"))
        assert got == (Collective("all_to_all", 64 * KiB, ("tp",)),)
        assert other.stats["requests"] == 0


def test_corrupt_cache_entries_are_recompiled(resharder, cache_root, tmp_path):
    shutil.copytree(cache_root / "reshard", tmp_path / "reshard")
    files = sorted((tmp_path / "reshard").rglob("*.json"))
    assert len(files) >= len(CASES)
    for i, f in enumerate(files):
        if i % 2:
            f.write_text("{not json")
        else:
            entry = json.loads(f.read_text())
            entry["collectives"] = [["all_reduce", 1.0, [7], 0]]  # no such mesh axis
            f.write_text(json.dumps(entry))
    transitions = [(SHAPE, "float32", *p.values[:3]) for p in CASES[:2]]
    with Resharder(MESH, "xla", cache_dir=tmp_path) as r:
        assert r.prefetch(transitions) == 2
        assert r.stats["requests"] == 1 and r.stats["disk_hits"] == 0
        for t, p in zip(transitions, CASES):
            assert r.reshard(*t[:4], partial=t[4]) == p.values[3]
    with Resharder(MESH, "xla", cache_dir=tmp_path) as r:  # rewritten whole
        assert r.prefetch(transitions) == 0 and r.stats["disk_hits"] == 2


def test_sixteen_devices_from_an_eight_device_process(tmp_path):
    assert jax.device_count() == 8
    mesh = MeshShape(("x", "y"), (4, 4))
    a2a = ((256, 1024), "float32", P("x", None), P(None, "x"))
    rs_ = ((256, 1024), "float32", P("x", None), P("x", "y"), ("y",))
    with Resharder(mesh, "xla", cache_dir=tmp_path) as r:
        assert r.prefetch([a2a, rs_]) == 2
        assert r.reshard(*a2a) == (Collective("all_to_all", 256 * KiB, ("x",)),)
        assert r.reshard(*rs_[:4], partial=rs_[4]) == (
            Collective("reduce_scatter", 256 * KiB, ("y",)),
        )
        assert r.stats["worker_starts"] == 1


def test_failed_compilation_falls_back_to_ideal(resharder):
    # 10 rows cannot be split 4 ways as an input sharding: jax refuses, the ideal model answers.
    got = resharder.lookup((10, 1024), "float32", P("model", None), P(None, "model"))
    assert got.source == "fallback"
    assert "IndivisibleError" in got.note or "divide" in got.note
    assert got.collectives == (Collective("all_to_all", 3 * 1024 * 4.0, ("model",)),)
    assert (
        resharder.fallbacks()[
            rs.Transition((10, 1024), "float32", (("model",), ()), ((), ("model",)), ())
        ]
        == got.note
    )


def test_timeout_falls_back_to_ideal(tmp_path):
    with Resharder(MESH, "xla", cache_dir=tmp_path, timeout_s=0.0, per_transition_s=0.0) as r:
        got = r.lookup(SHAPE, "float32", P("data", None), P(None, "model"))
    assert got.source == "fallback" and got.note.startswith("timeout")
    assert got.collectives == (Collective("all_gather", 64 * KiB, ("data",)),)
    assert not list((tmp_path / "reshard").rglob("*.json"))  # fallbacks are not cached


def test_subprocess_that_cannot_start_falls_back_once(tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_no_such_flag_anywhere=1")  # XLA aborts at start
    with Resharder(MESH, "xla", cache_dir=tmp_path) as r:
        first = r.lookup(SHAPE, "float32", P("data", None), P(None, "model"))
        assert first.source == "fallback" and "--xla_no_such_flag_anywhere" in first.note
        later = r.lookup(SHAPE, "float32", P("model", None), P(None, "model"))
        assert later.source == "fallback"
        assert later.note.startswith("the compiling subprocess cannot start")
        assert r.stats["worker_starts"] == 1


def test_ideal_mode_never_compiles(tmp_path):
    with Resharder(MESH, "ideal", cache_dir=tmp_path) as r:
        got = r.lookup(SHAPE, "float32", P("data", None), P(None, "model"))
        assert got.source == "ideal" and r.stats["requests"] == 0


IDEAL = [
    pytest.param(
        (("data",), ("model",)),
        (("model",), ("data",)),
        (),
        (Collective("all_to_all", 32 * KiB, ("data", "model")),),
        id="swap-two-axes",
    ),
    pytest.param(
        (("data", "model"),),
        (("model", "data"),),
        (),
        (Collective("collective_permute", 32 * KiB, ("data", "model")),),
        id="reorder-within-a-dim",
    ),
    pytest.param(
        (("data", "model"), ()),
        (("data",), ()),
        (),
        (Collective("all_gather", 128 * KiB, ("model",)),),
        id="gather-the-minor-axis",
    ),
    pytest.param(
        ((), ()),
        (("data",), ()),
        ("model",),
        (Collective("all_reduce", 128 * KiB, ("model",)),),
        id="slice-before-reducing",
    ),
    pytest.param(
        (("data",), ()),
        ((), ()),
        ("model",),
        (
            Collective("all_reduce", 128 * KiB, ("model",)),
            Collective("all_gather", 256 * KiB, ("data",)),
        ),
        id="reduce-then-gather",
    ),
]


@pytest.mark.parametrize("src, dst, partial, expected", IDEAL)
def test_ideal_model(src, dst, partial, expected):
    assert rs.ideal_collectives(SHAPE, "float32", src, dst, MESH, partial=partial) == expected


def test_size_one_axes_split_nothing():
    mesh = MeshShape(("pod", "data", "model"), (1, 2, 4))
    assert rs.ideal_collectives(SHAPE, "float32", P("pod", None), P(None, "pod"), mesh) == ()


ERRORS = [
    pytest.param(
        P("data", None, None),
        P(),
        (),
        r"source sharding .* rank at least 3, but was applied to a value of rank 2",
        id="rank",
    ),
    pytest.param(
        P("batch", None),
        P(),
        (),
        r"unknown mesh axis 'batch'; the mesh has data, model",
        id="unknown-axis",
    ),
    pytest.param(
        P(),
        P("data", "data"),
        (),
        r"destination sharding .* uses a mesh axis twice",
        id="axis-twice",
    ),
    pytest.param(
        P("model", None),
        P(),
        ("model",),
        r"partial axes \('model',\) also split dim 0 of the source",
        id="partial-split",
    ),
    pytest.param(P(), P(), ("pod",), r"partial: unknown mesh axis 'pod'", id="partial-unknown"),
]


@pytest.mark.parametrize("src, dst, partial, match", ERRORS)
def test_errors(src, dst, partial, match):
    with pytest.raises(ReshardError, match=match):
        rs.ideal_collectives(SHAPE, "float32", src, dst, MESH, partial=partial)


def test_bad_mode():
    with pytest.raises(ReshardError, match=r"mode 'gpu': expected 'xla' or 'ideal'"):
        Resharder(MESH, "gpu")


def test_permute_free_transitions_compile_without_a_collective_permute(cache_root):
    """`permute_free`'s class, compiled by XLA on a 3-axis mesh: 60 random transitions of it
    (a seeded draw, partial sums among them) make none, where a pipeline stage would hang
    on one (`soapjax.apply._pipelined.check_compiled`); outside it XLA makes them, the
    transitions of an expert layer whose axes change places and of a gather of one axis
    while another is sliced among them. (700 such random transitions on three meshes:
    docs/checks.md.)"""
    mesh = MeshShape(("node", "data", "model"), (2, 2, 2))
    rng = random.Random(7)

    def spec(rank):
        dims = [[] for _ in range(rank)]
        for a in mesh.axis_names:
            if (d := rng.randrange(rank + 1)) < rank:
                dims[d].append(a)
        for d in dims:
            rng.shuffle(d)
        return tuple(tuple(d) for d in dims)

    free = []
    while len(free) < 60:
        rank = rng.choice([2, 3, 4])
        src, dst = spec(rank), spec(rank)
        partial = tuple(a for a in mesh.axis_names
                        if rng.random() < 0.15 and not any(a in d for d in src))
        if rs.permute_free(src, dst, mesh):
            free.append(((16,) * rank, "float32", src, dst, partial))
    outside = [((8, 16, 4, 8), "float32", ((), ("node", "model"), (), ()),
                (("node",), ("model",), (), ()), ()),
               ((16, 16, 16), "float32", (("model",), (), ()), ((), (), ("data",)), ())]
    assert not any(rs.permute_free(t[2], t[3], mesh) for t in outside)
    with Resharder(mesh, "xla", cache_dir=cache_root) as xla:
        xla.prefetch(free + outside)
        kinds = [{c.kind for c in xla.lookup(*t[:4], partial=t[4]).collectives}
                 for t in free + outside]
    assert [t for t, k in zip(free, kinds) if "collective_permute" in k] == []
    assert all("collective_permute" in k for k in kinds[len(free):])
    assert sum(bool(k) for k in kinds[:len(free)]) >= 30  # most of them move data
