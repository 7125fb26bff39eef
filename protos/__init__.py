"""Generated gRPC code of loraserve (package loraserve.v1). Regenerate with `make protos`."""
