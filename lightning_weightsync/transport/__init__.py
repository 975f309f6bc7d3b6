"""Layer 2, moving bytes and messages: the ZeroMQ control plane (`control`), the data-plane backends
(`backends/`), and the device, executor and process helpers they share. Knows nothing of versions."""
