"""The inference service: DeepSeek-V3-family model, paged latent KV cache, LoRA slot pool,
adapter residency (S3 → pinned host cache → GPU slots), continuous batching, gRPC server."""
