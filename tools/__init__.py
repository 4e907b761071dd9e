"""Scripts the repository keeps beside the package: docs generators and shared helpers."""
