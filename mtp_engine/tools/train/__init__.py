"""Training the shipped model: a small Qwen3-Next with its MTP head, trained
from scratch on the Python standard library (``python -m mtp_engine.train``)."""
