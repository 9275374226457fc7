"""Integrations with the libraries people train with: `hf` patches a Hugging Face transformers model."""
