"""Example batches (importable, so pods and local workers find their handlers)."""
