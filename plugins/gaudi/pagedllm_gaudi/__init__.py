"""Intel Gaudi (HPU) backend for pagedllm. Not verified on hardware: see docs/backends/gaudi.md."""

__version__ = "0.2.0"
