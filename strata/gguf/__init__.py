"""GGUF files (llama.cpp's format): reading them, and turning their metadata, tokenizer and tensors into what
strata loads from a Hugging Face checkpoint."""
