"""Offloading runtime: expert store, bounded expert cache, predictive prefetch (torch)."""
