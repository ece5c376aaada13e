"""LoRARequest: the adapter a generation request runs with, named as vLLM names it."""
from __future__ import annotations

from dataclasses import dataclass

from strata.errors import RequestError


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter folder (`lora_path`) under a name and a positive integer id; the id identifies the adapter
    in the engine (its slot, its prefix-cache blocks), so two adapters must not share one."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise RequestError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}",
                               param="lora_request")
        if not self.lora_path:
            raise RequestError(f"LoRA adapter {self.lora_name!r} has no lora_path", param="lora_request")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def cache_key(self) -> bytes:
        """What the prefix cache chains into a request's first block: requests of different adapters (or of an
        adapter and the base model) never share KV blocks."""
        return f"lora:{self.lora_int_id}:{self.lora_name}:{self.lora_path}".encode()
