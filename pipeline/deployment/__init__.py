"""Deployment: ONNX export with its parity check, and the on-disk model registry."""
