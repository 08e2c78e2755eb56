"""batchinfer: offline, high-throughput batch document processing with LLMs."""

__version__ = "0.1.0"
