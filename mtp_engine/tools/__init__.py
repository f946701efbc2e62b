"""Tools around the engine: the benchmark (`bench`), the lossless check (`lossless`), random-weight models at real shapes (`synthetic`) and training the shipped model (`train`)."""
