"""The adapter store: PEFT uploads validated and normalized into the canonical layout,
weights in S3, metadata/versions/events in Redis. Also the lower layer both services share:
the canonical format, domain errors and gRPC plumbing (`adapter_store.rpc`)."""
