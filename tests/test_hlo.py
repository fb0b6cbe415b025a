"""soapjax.measure.hlo: collectives and FLOPs read from compiled HLO text."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from soapjax.measure import hlo
from soapjax.strategy.space import MeshShape
from soapjax.topology.cluster import load_topology, make_mesh

MESH_4x2 = MeshShape(("data", "model"), (4, 2))
MESH_2x4 = MeshShape(("data", "model"), (2, 4))


def _one(text: str, mesh=MESH_4x2, **kw) -> hlo.HloCollective:
    (c,) = hlo.collectives(text, mesh, **kw)
    return c


# --- the three replica_groups formats ------------------------------------------------------------

GROUPS = [
    pytest.param(
        "{{0,1},{2,3},{4,5},{6,7}}", ((0, 1), (2, 3), (4, 5), (6, 7)), ("model",), id="list"
    ),
    pytest.param("[4,2]<=[8]", ((0, 1), (2, 3), (4, 5), (6, 7)), ("model",), id="iota"),
    pytest.param(
        "[2,4]<=[4,2]T(1,0)", ((0, 2, 4, 6), (1, 3, 5, 7)), ("data",), id="iota-transposed"
    ),
    pytest.param(
        "mesh['axis_0'=4,'axis_1'=1,'axis_2'=2] {'axis_0'}",
        ((0, 2, 4, 6), (1, 3, 5, 7)),
        ("data",),
        id="mesh",
    ),
    pytest.param(
        "mesh['axis_0'=4,'axis_1'=2] {'axis_0','axis_1'}",
        ((0, 1, 2, 3, 4, 5, 6, 7),),
        ("data", "model"),
        id="mesh-two-axes",
    ),
    pytest.param(
        "mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_1'}",
        ((0, 2, 4, 6), (1, 3, 5, 7)),
        ("data",),
        id="mesh-device-ids",
    ),
    # 'axis_0':(2)2 is the minor factor 2 of axis_0 = [2 (pre), 2]: half of data.
    pytest.param(
        "mesh['axis_0'=4,'axis_1'=2] {'axis_0':(2)2}",
        ((0, 2), (1, 3), (4, 6), (5, 7)),
        ("data",),
        id="mesh-sub-axis",
    ),
    pytest.param(
        "mesh['axis_0'=4,'axis_1'=2] {'axis_0':(1)2}",
        ((0, 4), (1, 5), (2, 6), (3, 7)),
        ("data",),
        id="mesh-major-sub-axis",
    ),
]


@pytest.mark.parametrize("text, groups, axes", GROUPS)
def test_replica_group_formats(text, groups, axes):
    line = (
        f"  %ar = f32[16,32]{{1,0}} all-reduce(%p), channel_id=1, replica_groups={text}, "
        "use_global_device_ids=true, to_apply=%add"
    )
    c = _one(line)
    assert c.kind == "all-reduce"
    assert c.replica_groups == groups
    assert c.axes == axes
    assert c.nbytes == 16 * 32 * 4
    assert c.shapes == ("f32[16,32]",)
    assert hlo.parse_replica_groups(text) == groups


def test_mesh_form_with_permuted_devices_and_sub_axis():
    # Printed by XLA for P('data','model') -> P('model','data') on mesh (data=2, model=4):
    # the groups are pairs of neighbours along model, half of that axis.
    text = "mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_0':(2)2}"
    assert hlo.parse_replica_groups(text) == ((0, 1), (2, 3), (4, 5), (6, 7))
    line = (
        f"%a2a = (f32[1,16,256]{{2,1,0}}, f32[1,16,256]{{2,1,0}}) all-to-all(%x, %y), "
        f"channel_id=1, replica_groups={text}"
    )
    c = _one(line, MESH_2x4)
    assert (c.axes, c.group_size, c.nbytes) == (("model",), 2, 2 * 16 * 256 * 4)


def test_empty_replica_groups_mean_every_device():
    text = (
        "HloModule jit_f, num_partitions=8\n\nENTRY %main {\n"
        "  ROOT %ar = f32[4]{0} all-reduce(%p), replica_groups={}, to_apply=%add\n}\n"
    )
    c = _one(text)
    assert c.replica_groups == (tuple(range(8)),)
    assert c.axes == ("data", "model")


def test_unknown_replica_group_format_is_an_error():
    with pytest.raises(ValueError, match=r"replica_groups in an unknown format: 'devices=\[8\]"):
        hlo.parse_replica_groups("devices=[8]0,1")


def test_explicit_device_ids():
    # HLO that numbers the devices of the (data=4, model=2) mesh column-major.
    ids = np.arange(8).reshape(2, 4).T
    c = _one("%ar = f32[8]{0} all-reduce(%p), replica_groups={{0,1,2,3},{4,5,6,7}}", device_ids=ids)
    assert c.axes == ("data",)


# --- shapes, bytes and async pairs ---------------------------------------------------------------


def test_tuple_all_to_all_with_index_comments():
    parts = ", ".join(("/*index=5*/" if i == 5 else "") + "f32[8,1,128]{2,1,0}" for i in range(8))
    line = (
        f"%all-to-all.1 = ({parts}) all-to-all(%a, %b, %c, %d, %e, /*index=5*/%f, %g, %h), "
        "channel_id=1, replica_groups=[1,8]<=[8]"
    )
    c = _one(line)
    assert c.shapes == ("f32[8,1,128]",) * 8
    assert c.nbytes == 8 * 8 * 128 * 4
    assert c.axes == ("data", "model")


ASYNC = (
    "\n"
    "ENTRY %main {\n"
    "  %p = f32[16,32]{1,0} parameter(0)\n"
    "  %ags = (f32[16,32]{1,0}, f32[64,32]{1,0}) all-gather-start(%p), channel_id=1, "
    "replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}\n"
    "  %agd = f32[64,32]{1,0} all-gather-done(%ags)\n"
    "  %ars = bf16[64,32]{1,0} all-reduce-start(%agd), channel_id=2, "
    "replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add\n"
    "  %ard = bf16[64,32]{1,0} all-reduce-done(%ars)\n"
    "  %cps = (bf16[64,32]{1,0}, bf16[64,32]{1,0}, u32[], u32[]) collective-permute-start(%ard), "
    "channel_id=3, source_target_pairs={{0,2},{2,0},{1,3},{3,1}}\n"
    "  ROOT %cpd = bf16[64,32]{1,0} collective-permute-done(%cps)\n"
    "}\n"
)


def test_async_pairs_count_once_with_their_outputs():
    cs = hlo.collectives(ASYNC, MESH_4x2)
    assert [(c.kind, c.nbytes, c.axes) for c in cs] == [
        ("all-gather", 64 * 32 * 4, ("data",)),  # the output of the (input, output) tuple
        ("all-reduce", 64 * 32 * 2, ("model",)),
        ("collective-permute", 64 * 32 * 2, ("data",)),
    ]
    assert cs[2].source_target_pairs == ((0, 2), (2, 0), (1, 3), (3, 1))
    assert hlo.summarize(cs) == {
        "all-gather": (1, 8192),
        "all-reduce": (1, 4096),
        "collective-permute": (1, 4096),
    }


GPU_ASYNC = (
    "\n"
    "%wrapped_reduce_scatter (p: f32[16,4]) -> f32[4,4] {\n"
    "  %p = f32[16,4]{1,0} parameter(0)\n"
    "  ROOT %rs = f32[4,4]{1,0} reduce-scatter(%p), replica_groups={{0,2,4,6},{1,3,5,7}}, "
    "dimensions={0}\n"
    "}\n"
    "\n"
    "ENTRY %main (x: f32[16,4]) -> f32[8,4] {\n"
    "  %x = f32[16,4]{1,0} parameter(0)\n"
    "  %async-start = ((f32[16,4]{1,0}), f32[4,4]{1,0}, s32[]) async-start(%x), "
    "calls=%wrapped_reduce_scatter\n"
    "  %async-done = f32[4,4]{1,0} async-done(%async-start)\n"
    "  %a2a-start = ((f32[4,4]{1,0}), f32[4,4]{1,0}) all-to-all-start(%async-done), "
    "replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}\n"
    "  ROOT %a2a-done = f32[4,4]{1,0} all-to-all-done(%a2a-start)\n"
    "}\n"
)


def test_gpu_async_wrappers_count_once():
    cs = hlo.collectives(GPU_ASYNC, MESH_4x2)
    assert [(c.kind, c.nbytes, c.axes) for c in cs] == [
        ("reduce-scatter", 16 * 4 * 4, ("data",)),  # the wrapped instruction, its input
        ("all-to-all", 4 * 4 * 4, ("model",)),  # the output half of the -start tuple
    ]


def test_reduce_scatter_counts_its_input():
    c = _one(
        "%rs = f32[4,32]{1,0} reduce-scatter(%x), channel_id=1, "
        "replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, to_apply=%add"
    )
    assert c.nbytes == 4 * 32 * 4 * 4
    assert c.axes == ("data",)


def test_without_a_mesh_axes_are_none():
    (c,) = hlo.collectives("%ar = f32[8]{0} all-reduce(%p), replica_groups={{0,1}}")
    assert c.axes is None and c.replica_groups == ((0, 1),)


SLICED = """
%fused_slice (param_0: f32[32,1024], param_1: s32[]) -> f32[32,256] {
  %param_0 = f32[32,1024]{1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %c = s32[] constant(0)
  ROOT %ds = f32[32,256]{1,0} dynamic-slice(%param_0, %c, %param_1), dynamic_slice_sizes={32,256}
}

ENTRY %main (p: f32[32,1024]) -> f32[32,256] {
  %p = f32[32,1024]{1,0} parameter(0)
  %pid = u32[] partition-id()
  %all-reduce = f32[32,1024]{1,0} all-reduce(%p), replica_groups=[2,4]<=[8], to_apply=%add
  ROOT %f = f32[32,256]{1,0} fusion(%all-reduce, %pid), kind=kLoop, calls=%fused_slice
}
"""


def test_all_reduce_then_slice_reads_as_reduce_scatter_on_request():
    raw = _one(SLICED, MESH_2x4)
    assert (raw.kind, raw.nbytes, raw.axes) == ("all-reduce", 32 * 1024 * 4, ("model",))
    fused = _one(SLICED, MESH_2x4, reduce_scatter_from_slices=True)
    assert (fused.kind, fused.nbytes, fused.axes) == ("reduce-scatter", 32 * 1024 * 4, ("model",))
    assert fused.shapes == ("f32[32,256]",)  # what a reduce-scatter instruction would return
    # A slice that is not 1/group_size of the result stays an all-reduce.
    other = SLICED.replace("f32[32,256]", "f32[16,256]")
    assert _one(other, MESH_2x4, reduce_scatter_from_slices=True).kind == "all-reduce"


# XLA:CPU's float normalization: bfloat16 collectives sent in float32. A promoted all-reduce, an
# all-gather of a bfloat16 value widened in a fusion, and a combined all-reduce of a float32
# gradient, a widened one and a bfloat16 sum accumulated in float32.
WIDENED = """HloModule m, num_partitions=8

%sum_promoted (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%widen (w: bf16[8,16]) -> f32[8,16] {
  %w = bf16[8,16]{1,0} parameter(0)
  ROOT %c = f32[8,16]{1,0} convert(%w)
}

%narrow (y: f32[32]) -> bf16[32] {
  %y = f32[32]{0} parameter(0)
  ROOT %c = bf16[32]{0} convert(%y)
}

%widened_sum (v: bf16[4,32]) -> f32[32] {
  %v = bf16[4,32]{1,0} parameter(0)
  %cv = f32[4,32]{1,0} convert(%v)
  %zero = f32[] constant(0)
  ROOT %r = f32[32]{0} reduce(%cv, %zero), dimensions={0}, to_apply=%sum_promoted
}

ENTRY %main (p: f32[16,32], q: bf16[8,16], g: f32[64], h: bf16[4,32], k: bf16[32]) -> f32[] {
  %p = f32[16,32]{1,0} parameter(0)
  %q = bf16[8,16]{1,0} parameter(1)
  %g = f32[64]{0} parameter(2)
  %h = bf16[4,32]{1,0} parameter(3)
  %k = bf16[32]{0} parameter(4)
  %all-reduce = f32[16,32] all-reduce(%p), replica_groups=[2,4]<=[8], to_apply=%sum_promoted
  %f = f32[8,16]{1,0} fusion(%q), kind=kLoop, calls=%widen
  %all-gather = f32[16,16]{1,0} all-gather(%f), replica_groups=[4,2]<=[8], dimensions={0}
  %wk = f32[32]{0} convert(%k)
  %s = f32[32]{0} fusion(%h), kind=kLoop, calls=%widened_sum
  %ar = (f32[64], f32[32], f32[32]) all-reduce(%g, %wk, %s), replica_groups=[2,4]<=[8], to_apply=%t
  %g0 = f32[64]{0} get-tuple-element(%ar), index=0
  %g1 = f32[32]{0} get-tuple-element(%ar), index=1
  %g2 = f32[32]{0} get-tuple-element(%ar), index=2
  %n1 = bf16[32]{0} convert(%g1)
  %n2 = bf16[32]{0} fusion(%g2), kind=kLoop, calls=%narrow
  %ng = bf16[16,16]{1,0} convert(%all-gather)
  ROOT %z = f32[64]{0} add(%g0, %g0)
}
"""


def test_bfloat16_collectives_xla_cpu_widened_read_as_the_program_sends_them():
    """`narrow_as_sent`: each float32 buffer XLA:CPU widened from bfloat16 (and narrows again
    after) counts its bfloat16 bytes (the program's own type, what a GPU sends); a float32
    gradient in the same combined all-reduce keeps its 4 bytes; without the option every
    buffer is read as compiled."""
    raw = hlo.collectives(WIDENED, MESH_2x4)
    assert [c.nbytes for c in raw] == [16 * 32 * 4, 16 * 16 * 4, (64 + 32 + 32) * 4]
    sent = hlo.collectives(WIDENED, MESH_2x4, narrow_as_sent=True)
    assert [c.nbytes for c in sent] == [16 * 32 * 2, 16 * 16 * 2, 64 * 4 + 32 * 2 + 32 * 2]
    assert sent[2].shapes == ("f32[64]", "bf16[32]", "bf16[32]")
    # a float32 value the program computed in float32 (no convert of a 2-byte one) stays so
    plain = WIDENED.replace("to_apply=%sum_promoted\n  %f", "to_apply=%sum\n  %f")
    assert hlo.collectives(plain, MESH_2x4, narrow_as_sent=True)[0].nbytes == 16 * 32 * 4
    # a widened value the program goes on using in float32 was sent in float32 (a float32
    # parameter's gradient computed in bfloat16 and widened before its all-reduce)
    kept = WIDENED.replace("%n1 = bf16[32]{0} convert(%g1)", "%n1 = f32[32]{0} add(%g1, %g1)")
    assert hlo.collectives(kept, MESH_2x4, narrow_as_sent=True)[2].shapes == (
        "f32[64]", "f32[32]", "bf16[32]")


# --- real compiled HLO ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh():
    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    return Mesh(devices, ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def _compiled(mesh, src, dst, shape=(64, 1024)):
    f = jax.jit(
        lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, dst)),
        in_shardings=NamedSharding(mesh, src),
    )
    return f.lower(jax.ShapeDtypeStruct(shape, jnp.float32)).compile().as_text()


def test_compiled_all_to_all(mesh):
    cs = hlo.collectives(_compiled(mesh, P("model", None), P(None, "model")), mesh)
    assert [(c.kind, c.nbytes, c.axes, c.group_size) for c in cs] == [
        ("all-to-all", 64 * 1024 * 4 // 4, ("model",), 4)
    ]
    assert cs[0].shapes == ("f32[16,1,256]",) * 4


def test_compiled_permute_and_partial_all_gather(mesh):
    cs = hlo.collectives(_compiled(mesh, P("model", None), P("data", None)), mesh)
    assert hlo.summarize(cs) == {"collective-permute": (1, 65536), "all-gather": (1, 131072)}
    assert [(c.kind, c.axes, c.group_size) for c in cs] == [
        ("collective-permute", ("data", "model"), 2),
        ("all-gather", ("model",), 2),
    ]


def test_compiled_with_a_permuted_device_order_reads_the_same(mesh):
    # Ids in compiled HLO are positions in the mesh, whatever devices sit there.
    shuffled = Mesh(
        mesh.devices.flat[[3, 1, 0, 2, 7, 5, 6, 4]].reshape(2, 4),
        mesh.axis_names,
        axis_types=(AxisType.Auto,) * 2,
    )
    cs = hlo.collectives(_compiled(shuffled, P(None, "model"), P()), shuffled)
    assert [(c.kind, c.nbytes, c.axes) for c in cs] == [("all-gather", 262144, ("model",))]


def test_collectives_inside_loops_count_once_per_iteration(mesh):
    # h @ W with W's rows split over model: a partial sum all-reduced (here reduce-scattered)
    # in every one of the scan's 8 steps; the final sum's all-reduces run once.
    def f(h0, w, xs):
        def body(h, x):
            h = jnp.tanh(h @ w + x)
            return h, h
        return jax.lax.scan(body, h0, xs)[1].sum()

    shardings = (NamedSharding(mesh, P("data", "model")), NamedSharding(mesh, P("model", None)),
                 NamedSharding(mesh, P(None, "data", "model")))
    args = (jax.ShapeDtypeStruct((4, 32), jnp.float32), jax.ShapeDtypeStruct((32, 32), jnp.float32),
            jax.ShapeDtypeStruct((8, 4, 32), jnp.float32))
    text = jax.jit(f, in_shardings=shardings).lower(*args).compile().as_text()
    cs = hlo.collectives(text, mesh, reduce_scatter_from_slices=True)
    in_loop = [c for c in cs if "while/body" in c.op_name]
    assert in_loop and all(c.executions == 8 for c in in_loop)
    assert all(c.executions == 1 for c in cs if "while/body" not in c.op_name)
    text_bytes = sum(c.nbytes for c in cs)
    run_bytes = sum(c.nbytes * c.executions for c in cs)
    assert hlo.summarize(cs, executed=True) != hlo.summarize(cs)
    assert sum(b for _, b in hlo.summarize(cs, executed=True).values()) == run_bytes > text_bytes


def test_executions_multiply_through_nested_loops():
    text = (
        "HloModule m, num_partitions=2\n"
        "\n"
        "%inner_body (p: f32[4]) -> f32[4] {\n"
        "  %p = f32[4]{0} parameter(0)\n"
        "  ROOT %ar = f32[4]{0} all-reduce(%p), replica_groups={{0,1}}, to_apply=%add\n"
        "}\n"
        "\n"
        "%outer_body (q: f32[4]) -> f32[4] {\n"
        "  %q = f32[4]{0} parameter(0)\n"
        "  ROOT %w = f32[4]{0} while(%q), condition=%cond, body=%inner_body, "
        'backend_config={"known_trip_count":{"n":"3"}}\n'
        "}\n"
        "\n"
        "ENTRY %main (x: f32[4]) -> f32[4] {\n"
        "  %x = f32[4]{0} parameter(0)\n"
        "  %ag = f32[4]{0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add\n"
        "  ROOT %w2 = f32[4]{0} while(%ag), condition=%cond, body=%outer_body, "
        'backend_config={"known_trip_count":{"n":"5"}}\n'
        "}\n"
    )
    cs = hlo.collectives(text)
    assert sorted((c.name, c.executions) for c in cs) == [("ag", 1), ("ar", 15)]
    assert hlo.summarize(cs, executed=True) == {"all-reduce": (16, 16 * 16)}


# --- FLOPs (`soapjax.measure._hlo_flops`)
# ---------------------------------------------------------------


def test_hlo_flops_counts_every_trip_of_a_loop_and_leaves_all_reduces_out():
    def f(x, w):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w) + 1.0, None), x, None, length=10)[0]

    avals = (jax.ShapeDtypeStruct((8, 16), jnp.float32),
             jax.ShapeDtypeStruct((16, 16), jnp.float32))
    counted = hlo.hlo_flops(jax.jit(f).lower(*avals).compile().as_text())
    body = 2 * 8 * 16 * 16 + 8 * 16 + 2  # matmul, add, the loop counter's add and compare
    assert (counted.flops, counted.transcendentals) == (body, 8 * 16)  # cost_analysis()'s
    assert counted.loop_extra == 9 * body and counted.compute == 10 * body
    mesh = make_mesh(load_topology("cpu8"))
    summed = jax.jit(lambda x: x.sum(0), in_shardings=NamedSharding(mesh, P(
        ("data", "model"))), out_shardings=NamedSharding(mesh, P()))
    reduced = hlo.hlo_flops(
        summed.lower(jax.ShapeDtypeStruct((64, 32), jnp.float32)).compile().as_text())
    assert reduced.all_reduce == 32  # XLA's 1 FLOP per element: communication here
    assert reduced.compute == 8 * 32 - 32  # each device sums its 8 rows


def test_compiled_bfloat16_partial_sums_read_as_bfloat16(mesh):
    """A bfloat16 matmul pair with the hidden dim split over ``model``: XLA:CPU all-gathers a
    widened copy and all-reduces the partial sums promoted to float32; read as sent, both are
    the bfloat16 bytes of the values."""
    def f(x, w1, w2):
        return jnp.tanh(x @ w1) @ w2

    shardings = (NamedSharding(mesh, P("data", None)), NamedSharding(mesh, P(None, "model")),
                 NamedSharding(mesh, P("model", None)))
    args = (jax.ShapeDtypeStruct((16, 32), jnp.bfloat16),
            jax.ShapeDtypeStruct((32, 64), jnp.bfloat16),
            jax.ShapeDtypeStruct((64, 32), jnp.bfloat16))
    text = jax.jit(f, in_shardings=shardings).lower(*args).compile().as_text()
    raw = hlo.collectives(text, mesh)
    sent = hlo.collectives(text, mesh, narrow_as_sent=True)
    assert raw and all("f32" in c.shapes[0] for c in raw)  # as XLA:CPU compiled them
    assert [c.nbytes * 2 for c in sent] == [c.nbytes for c in raw]
    assert all(c.shapes[0].startswith("bf16") for c in sent)
