"""Layer 1, pure data: how tensors become chunks (`chunks`), what goes over the wire (`messages`), and the
dtype allow-list (`dtypes`). No sockets, no processes, no threads: everything above builds on it."""
