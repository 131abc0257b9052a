"""Integrations with other libraries; each needs its own optional dependencies."""
