"""Layer 1, pure data: how tensors become chunks (`chunks`), what goes over the wire (`messages`, with the
bounds in `limits` and each backend's join kind in `joins/`), and the dtype allow-list (`dtypes`). No
sockets, no processes, no threads: everything above builds on it."""
