"""Trainer side: BaguaStrategy, its algorithms and bucket machinery (runs in every training rank)."""
