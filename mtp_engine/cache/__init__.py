"""The engine's caches: per-token recurrent-state capture (`capture`) and the
operations a speculative step performs on a model's caches (`ops`)."""
