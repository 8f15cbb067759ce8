"""The Batch API's state: uploaded files, batches and their lines' progress (see policies/batches/store.py)."""
