"""The engine's caches: per-token recurrent-state capture (`capture`) and a
batch's caches, rows joining, leaving and committing (`batch`)."""
