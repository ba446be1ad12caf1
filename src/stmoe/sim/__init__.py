"""Simulator of ST-MoE's pipeline and accelerator, and of the systems it is compared with."""
