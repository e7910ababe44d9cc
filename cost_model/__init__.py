"""What a training step should cost, computed rather than measured: the roofline and its predictions, memory,
scaling over GPUs and the published points they are checked against (cost_model/README.md)."""
