"""LoRA adapters added and removed while the engine serves (vLLM's `/v1/load_lora_adapter`
and `/v1/unload_lora_adapter`, and `LLMEngine.add_lora`/`remove_lora`).

The adapter's files are read and checked by the caller (`read`, on any thread: the engine
thread never waits on a disk); the engine thread then registers it (`add`). An unload
refuses new requests for the adapter at once and drops it once no unfinished request
uses it (`finish_unloads`, after every step), so a request that started under an adapter
ends under the same weights.

Under tensor or pipeline parallelism every rank holds its own shard of each adapter and
rank 0 sends only adapter indices with each step; runtime changes are refused there.
"""

from __future__ import annotations

from backend.engine.errors import InvalidRequestError


class RuntimeLoRA:
    def __init__(self, lora, scheduler, parallel: bool) -> None:
        """lora: the runner's LoRAManager (None without enable_lora); scheduler: whose
        unfinished requests hold adapters; parallel: the engine has other ranks."""
        self.lora = lora
        self.scheduler = scheduler
        self.parallel = parallel

    def _manager(self):
        if self.lora is None:
            raise InvalidRequestError("LoRA is not enabled on this model: loading adapters at run time needs the "
                                      "engine argument enable_lora")
        if self.parallel:
            raise InvalidRequestError("adapters cannot be loaded or unloaded at run time under tensor or pipeline "
                                      "parallelism yet; list them in the engine argument lora_modules")
        return self.lora

    def read(self, name: str, path: str):
        """The adapter at `path`, read and checked (LoRAConfigError names what is wrong).
        Any thread: reads only the manager's fixed settings."""
        if not name or not isinstance(name, str):
            raise InvalidRequestError("'lora_name' must be a non-empty string")
        if not path or not isinstance(path, str):
            raise InvalidRequestError("'lora_path' must be a non-empty string: the adapter's folder on the server")
        return self._manager().read_checked(name, path)

    # ------------------------------------------------------------ engine thread
    def add(self, adapter) -> None:
        self._manager().add(adapter)

    def remove(self, name: str) -> bool:
        """Start unloading `name`; True when it is gone already (no request used it)."""
        self._manager().begin_unload(name)
        return name in self.finish_unloads()

    def finish_unloads(self) -> list[str]:
        """Drop the adapters being unloaded that no unfinished request uses."""
        if self.lora is None or not self.lora.unloading:
            return []
        in_use = {r.sampling_params.lora_name for r in self.scheduler.requests.values()}
        return self.lora.finish_unloads(in_use)

    def listing(self) -> dict[str, list[str]]:
        """{"loaded": names serving, "unloading": names waiting for their requests}."""
        if self.lora is None:
            return {"loaded": [], "unloading": []}
        # Any thread: each collection copied in one C-level call first.
        names, unloading = list(self.lora.paths), set(list(self.lora.unloading))
        return {"loaded": [n for n in names if n not in unloading], "unloading": sorted(unloading)}
