"""Worker processes: weights, KV-cache tensors, forward passes and sampling."""
