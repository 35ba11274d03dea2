"""Bagua algorithms implemented natively on torch.distributed."""
