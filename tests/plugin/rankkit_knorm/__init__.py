"""KNorm (Devoto et al. 2024) for rankkit: keep the keys of smallest L2 norm."""
