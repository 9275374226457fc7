"""The runtime: executes a plan in PyTorch over torch.distributed. `ops` (the attention kernels over DLPack) and
`blocks` (one block pair) below, `topology` (who holds and sends what, no processes), `comm` (groups, transfers,
the distributed contract) and `ring` (one layer) above them, `nn` (the public modules) on top; `documents` (packed
sequences) and `states` (uneven sharding of the model states) beside them. Only `ops` loads without PyTorch."""
