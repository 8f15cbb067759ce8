"""vLLM's LoRA surface, simulated: adapters loaded at run time and served as models (vLLM 0.32's shapes).

With `enable_lora` the server takes POST /v1/load_lora_adapter {lora_name, lora_path} (the path must be a
directory with an adapter_config.json, else 404 "No adapter found"; a name already loaded is a 400) and
/v1/unload_lora_adapter {lora_name} (404 for one it does not hold), lists its adapters in /v1/models with
`parent`, and answers a request that names one (its `model` in the answer). A load takes `lora_load_ms`.
`loads` and `unloads` count what it did, for tests and benchmarks (GET /lora_stats).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Protocol

from .config import SimConfig
from .exchange import Http
from .protocol import ApiError


class Host(Protocol):
    """What these routes use of the simulator's app (tools/simulator/app.py)."""

    cfg: SimConfig


class Lora:
    def __init__(self, app: Host) -> None:
        self.app = app
        self.loaded: dict[str, str] = {}  # lora_name -> path
        self.loads = 0
        self.unloads = 0
        self.routes = {"/v1/load_lora_adapter": self.load, "/v1/unload_lora_adapter": self.unload}

    def holds(self, name: str) -> bool:
        return name in self.loaded

    async def load(self, http: Http) -> None:
        body = await http.read_json()
        name, path = (body or {}).get("lora_name"), (body or {}).get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise ApiError(400, "lora_name and lora_path are required", "BadRequestError")
        if name in self.loaded:
            raise ApiError(400, f"The lora adapter '{name}' has already been loaded. If you want to load the adapter"
                           " in place, set 'load_inplace' to True.", "InvalidUserInput")
        await asyncio.sleep(self.app.cfg.lora_load_ms / 1000)
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise ApiError(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError")
        self.loaded[name] = path
        self.loads += 1
        await http.reply(200, f"Success: LoRA adapter '{name}' added successfully.".encode(), b"text/plain")

    async def unload(self, http: Http) -> None:
        body = await http.read_json()
        name = (body or {}).get("lora_name")
        if not isinstance(name, str) or self.loaded.pop(name, None) is None:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        self.unloads += 1
        await http.reply(200, f"Success: LoRA adapter '{name}' removed successfully.".encode(), b"text/plain")

    async def stats(self, http: Http) -> None:
        await http.json(200, {"loaded": list(self.loaded), "loads": self.loads, "unloads": self.unloads})

    def model_entries(self, created: int) -> list[dict[str, Any]]:
        return [{"id": name, "object": "model", "created": created, "owned_by": "vllm", "root": path,
                 "parent": self.app.cfg.model, "max_model_len": self.app.cfg.max_model_len, "permission": []}
                for name, path in self.loaded.items()]
