"""Stage 1, jaxpr to operator graph: a traced loss grouped into operators whose dims are labelled
sample, attribute, parameter or reduction.

- `_dims`: Dimension labels through a jaxpr: which dims of which values must be split alike.
- `_grouping`: Operator grouping and dim analysis: the program's equations become operators.
- `_inner`: Reductions inside an operator that a split turns into collectives of their own.
- `_ir`: The operator graph's records: operators, their operands and outputs, dim roles.
- `_local`: The per-device program of one operator at a shard shape.
- `_program`: The traced function as a flat program of equations over integer value ids.
- `opgraph`: The operator graph: a traced forward pass grouped into operators with dim roles.

Its public names are `soapjax.graph.opgraph`'s, re-exported here.
"""

from soapjax.graph import opgraph as _opgraph
from soapjax.graph.opgraph import (
    LeafInfo as LeafInfo,
    Operand as Operand,
    Operator as Operator,
    OpGraph as OpGraph,
    OutputTensor as OutputTensor,
    Program as Program,
    ReductionDim as ReductionDim,
    module_of_param as module_of_param,
    trace as trace,
)

__all__ = list(_opgraph.__all__)  # the names of `soapjax.graph.opgraph`
