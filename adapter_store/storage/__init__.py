"""The store's two backends behind small interfaces: S3 objects (weights, manifests, records)
and Redis metadata (index, version counters, events)."""
