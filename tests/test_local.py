"""soapjax._local: shard programs keep custom derivative rules (never a silent primal)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from soapjax._local import CustomRuleError, has_custom_rules, operator_fn
from soapjax.graph import trace


@jax.custom_vjp
def ste_round(x):
    return jnp.round(x)


ste_round.defvjp(lambda x: (jnp.round(x), None), lambda _, g: (g,))


@jax.custom_jvp
def relu(x):
    return jnp.maximum(x, 0.0)


relu.defjvp(lambda p, t: (relu(p[0]), jnp.where(p[0] > 0, t[0], 0.0)))


def ste_loss(params, batch):
    return jnp.sum(ste_round(batch @ params["w"]) ** 2)


def relu_loss(params, batch):  # relu at exactly 0: the rule says 0, max's tie rule says 1/2
    return jnp.sum(relu(batch @ params["w"]))


def _graph_and_env(loss, params, batch):
    g = trace(loss, params, batch)
    env = dict(zip([leaf.value for leaf in g.params + g.batch], jax.tree.leaves((params, batch))))
    return g, env


def _replace_all(g, **kw):
    return {op.name: operator_fn(g, op.name, **kw)[0] for op in g.operators if g.replaceable(op.name)}


@pytest.mark.parametrize("loss", [ste_loss, relu_loss], ids=["custom_vjp-ste", "custom_jvp-relu"])
def test_whole_operator_programs_keep_custom_rules(loss):
    params = {"w": jnp.eye(4) * 0.5}
    batch = jnp.asarray([[1.0, -2.0, 0.0, 3.0]] * 8) * jnp.arange(8.0)[:, None] / 3
    g, _ = _graph_and_env(loss, params, batch)
    assert any(has_custom_rules(g, op.name) for op in g.operators)
    replaced = _replace_all(g)
    assert replaced, "the operator holding the rule is computed by its own program"

    def via_programs(p, b):
        return g.evaluate(*jax.tree.leaves(p), *jax.tree.leaves(b), replace=replaced)

    want = jax.grad(loss)(params, batch)
    got = jax.grad(via_programs)(params, batch)
    np.testing.assert_array_equal(got["w"], want["w"])


def test_straight_through_gradient_is_the_identity_rule():
    params = {"w": jnp.eye(4) * 0.3}
    batch = jnp.arange(32.0).reshape(8, 4) / 7
    g, _ = _graph_and_env(ste_loss, params, batch)
    replaced = _replace_all(g)
    got = jax.grad(lambda p, b: g.evaluate(p["w"], b, replace=replaced))(params, batch)["w"]
    h = batch @ params["w"]
    np.testing.assert_allclose(got, batch.T @ (2 * jnp.round(h)), rtol=1e-6)
    assert float(jnp.abs(got).max()) > 1  # the primal (round) would give exactly 0


def test_split_custom_rule_is_refused_or_priced_as_primal():
    params = {"w": jnp.eye(4)}
    batch = jnp.ones((8, 4))
    g, env = _graph_and_env(ste_loss, params, batch)
    op = next(op for op in g.operators if has_custom_rules(g, op.name))
    degrees = tuple(2 if s == 8 else 1 for s in op.iteration_sizes)  # the batch dim (an R here)
    fn, avals = operator_fn(g, op.name, degrees)
    with pytest.raises(CustomRuleError, match="custom_vjp_call.*traced for"):
        jax.eval_shape(fn, *avals)
    fn, avals = operator_fn(g, op.name, degrees, rules="primal")  # the cost stage's timing
    assert [a.shape for a in avals] == [(4, 4), (4, 4)]
    assert jax.eval_shape(fn, *avals)[0].shape == ()
