"""Developer tools: demo model training, the demo driver."""
