"""The batch one forward runs on: the types the executor builds (rollout/exec) and the models read
(rollout/models): ForwardBatch with its attention segments, decode cascade and paged-KV metadata,
the KV pool, and the host-to-device staging they are filled through. Imports nothing above it."""
