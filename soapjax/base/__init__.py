"""Stage 0, the leaves every stage may import: errors, caches, dtype sizes, the collectives' closed
forms, and attention as models call it.

- `_cache`: Where soapjax keeps its on-disk caches: one root, one folder per kind.
- `_dtypes`: Byte sizes of the dtypes a traced program holds, PRNG keys included.
- `_progress`: A progress line on stderr, for a terminal and for a log alike.
- `attention`: Attention as models call it and plans run it: flash attention, one operator of the
  graph,
- `collectives`: What a collective costs: one table of ring closed forms, for a group of any size.
- `errors`: The exceptions soapjax raises for user mistakes, one class per kind of mistake.
"""

__all__: list[str] = []
