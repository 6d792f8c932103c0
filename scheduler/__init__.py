"""The scheduler process: requests, KV blocks, the per-step plan."""
