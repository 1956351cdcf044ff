"""The algorithms: segmentation, probes, values, redistribution, IBPO, Monte-Carlo values (no verl, no ray)."""
