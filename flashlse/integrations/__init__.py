"""Integrations with the libraries users already call: ``flashlse.integrations.transformers``
registers flashlse as a HuggingFace transformers attention implementation."""
