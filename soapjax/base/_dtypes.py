"""Byte sizes of the dtypes a traced program holds, PRNG keys included.

`np.dtype` does not know JAX's extended dtypes: an nnx model's dropout stream holds a typed key
(`key<fry>`, two uint32 words), and `np.dtype("key<fry>")` raises. One helper, used wherever a
shape and a dtype name become bytes.

>>> itemsize("float32"), itemsize("bfloat16"), itemsize("key<fry>")
(4, 2, 8)
"""

from __future__ import annotations

import jax.numpy as jnp

# Words of uint32 per key of each of JAX's PRNG implementations.
_KEY_BYTES = {"fry": 8, "rbg": 16, "unsafe_rbg": 16}


def is_key(dtype: str) -> bool:
    """Whether `dtype` names a typed PRNG key (``key<fry>``)."""
    return str(dtype).startswith("key<")


def itemsize(dtype: object) -> int:
    """Bytes per element of `dtype` (a name or a dtype), typed PRNG keys included."""
    name = str(dtype)
    if is_key(name):
        return _KEY_BYTES.get(name[4:-1], 8)
    return jnp.dtype(name).itemsize


def is_float(dtype: object) -> bool:
    """Whether `dtype` is a floating (or complex) dtype; typed PRNG keys are not."""
    return not is_key(str(dtype)) and jnp.issubdtype(jnp.dtype(dtype), jnp.inexact)
