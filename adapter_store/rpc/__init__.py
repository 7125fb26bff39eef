"""gRPC plumbing shared by both services: error mapping, request logging, server lifecycle,
and settings read from flags or `LORASERVE_*` environment variables."""
