"""LoRA adapters: the request naming one (LoRARequest) and PEFT adapter folders read and checked (peft.py)."""
