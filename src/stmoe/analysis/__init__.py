"""Correlation analysis: the spatial and temporal evidence behind ST-MoE, and its report."""
