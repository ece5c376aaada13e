"""Multimodal inputs: loading images from requests and model-specific image preprocessing."""
from __future__ import annotations
