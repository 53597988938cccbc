"""geometry: the coordinates a gradient may travel in (whitening, subspace rotation, Hadamard),
what builds them (FSDP row blocks, stacks of one shape), what judges them (the error the
optimizer sees) and the check that every rank holds the same."""
