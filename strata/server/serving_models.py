"""The model names a server answers to: the base model's served names and its LoRA adapters (vLLM's
`--lora-modules` and, when runtime updates are allowed, /v1/load_lora_adapter and /v1/unload_lora_adapter)."""
from __future__ import annotations

import itertools
import logging

from strata.engine.async_engine import AsyncEngine
from strata.errors import ConfigError, NotFoundError, RequestError
from strata.lora.request import LoRARequest
from strata.server.lora_modules import LoRAModulePath
from strata.server.protocol import ModelCard

logger = logging.getLogger(__name__)

class ServingModels:
    """The served names of the base model and the adapters served beside it, each by its name."""

    def __init__(self, engine: AsyncEngine, lora_modules: list[LoRAModulePath] | None = None) -> None:
        """`lora_modules` (--lora-modules) are loaded now, before the server takes requests (a bad one stops
        start-up)."""
        self.engine = engine
        self.base_names = list(engine.config.served_model_names)
        model = engine.config.model
        # root: the model as given, as vLLM has it (a GGUF file, not its folder; a Hub ID, not the cache path)
        self.root = model.source.model if model.source else model.path
        self.loras: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._load_static(lora_modules or [])

    @property
    def names(self) -> list[str]:
        return self.base_names + list(self.loras)

    def check_model(self, name: str | None) -> str:
        """The served name to answer with; a missing or empty `model` means the first served name."""
        if not name:
            return self.base_names[0]
        if name not in self.base_names and name not in self.loras:
            served = ", ".join(f"`{n}`" for n in self.names)
            raise NotFoundError(f"The model `{name}` does not exist. This server serves {served} (GET /v1/models).",
                                param="model")
        return name

    def lora_request(self, name: str) -> LoRARequest | None:
        """The adapter a served name runs with (None: the base model); a name unloaded meanwhile is a 404."""
        if name in self.base_names:
            return None
        lora = self.loras.get(name)
        if lora is None:
            raise NotFoundError(f"The model `{name}` does not exist (its LoRA adapter was unloaded).", param="model")
        return lora

    def cards(self, max_model_len: int) -> list[ModelCard]:
        cards = [ModelCard(id=name, root=self.root, max_model_len=max_model_len) for name in self.base_names]
        cards += [ModelCard(id=name, root=lora.lora_path, parent=lora.base_model_name or self.base_names[0],
                            max_model_len=max_model_len) for name, lora in self.loras.items()]
        return cards

    def _new_request(self, name: str, path: str, base_model_name: str | None) -> LoRARequest:
        if self.engine.config.lora is None:
            raise RequestError("this server was started without --enable-lora: it serves no LoRA adapters",
                               param="lora_name")
        if name in self.loras:
            raise RequestError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        if name in self.base_names:
            raise RequestError(f"'{name}' is the base model's served name; give the adapter another name",
                               param="lora_name")
        if base_model_name is not None and base_model_name not in self.base_names:
            raise RequestError(f"base_model_name {base_model_name!r} is not a served name of the base model "
                               f"({', '.join(self.base_names)})", param="base_model_name")
        return LoRARequest(name, next(self._ids), path, base_model_name)

    async def load_lora(self, name: str, path: str, base_model_name: str | None = None) -> None:
        """Load and check an adapter on the engine, then serve it as `name` (400 with the reason if refused)."""
        lora = self._new_request(name, path, base_model_name)
        await self.engine.add_lora(lora)
        if name in self.loras:  # loaded twice at once: the first one won
            raise RequestError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        self.loras[name] = lora
        logger.info("serving LoRA adapter %r from %s", name, path)

    async def unload_lora(self, name: str) -> None:
        lora = self.loras.pop(name, None)
        if lora is None:
            raise NotFoundError(f"The lora adapter '{name}' cannot be found.", param="lora_name")
        await self.engine.remove_lora(lora.lora_int_id)
        logger.info("LoRA adapter %r unloaded", name)

    def _load_static(self, modules: list[LoRAModulePath]) -> None:
        if modules and self.engine.config.lora is None:
            raise ConfigError("--lora-modules needs --enable-lora", param="lora_modules")
        for module in modules:
            try:
                lora = self._new_request(module.name, module.path, module.base_model_name)
                self.engine.call_in_core(self.engine.core.add_lora, lora).result()
            except RequestError as e:
                raise ConfigError(f"--lora-modules {module.name}={module.path}: {e.message}",
                                  param="lora_modules") from None
            self.loras[module.name] = lora
            logger.info("serving LoRA adapter %r from %s", module.name, module.path)
