"""geometry: the coordinates a gradient may travel in (whitening, subspace rotation, Hadamard),
what builds them (eigensolver, FSDP row blocks), what judges them (the error the optimizer sees)
and the check that every rank holds the same."""
