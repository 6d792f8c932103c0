"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies, answers and status codes).

Routed only when runtime updating is allowed (--allow-runtime-lora-updating or TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING;
otherwise they are absent, a 404 as any unknown path) and, as every API path, behind --api-key (frontend/auth.py).
"""

from __future__ import annotations

from aiohttp import web
from msgspec import Struct

from tokenmill.frontend.context import ServingContext, read_body
from tokenmill.frontend.errors import APIError
from tokenmill.frontend.protocol import decode_request


class LoadLoRAAdapterRequest(Struct, kw_only=True):
    lora_name: str = ""
    lora_path: str = ""


class UnloadLoRAAdapterRequest(Struct, kw_only=True):
    lora_name: str = ""


async def load_lora_adapter(ctx: ServingContext, request: web.Request) -> web.Response:
    body: LoadLoRAAdapterRequest = decode_request(await read_body(request), LoadLoRAAdapterRequest)
    if not body.lora_name or not body.lora_path:
        raise APIError(
            400, "Both 'lora_name' and 'lora_path' must be provided.", "lora_path" if body.lora_name else "lora_name"
        )
    ctx.lora.load(body.lora_name, body.lora_path)
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(ctx: ServingContext, request: web.Request) -> web.Response:
    body: UnloadLoRAAdapterRequest = decode_request(await read_body(request), UnloadLoRAAdapterRequest)
    if not body.lora_name:
        raise APIError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
    ctx.lora.unload(body.lora_name)
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def add_lora_routes(app: web.Application, ctx: ServingContext) -> None:
    """The runtime load/unload endpoints, when the config allows them."""
    lora = ctx.config.lora
    if not (lora.enable_lora and lora.allow_runtime_lora_updating):
        return
    app.router.add_post("/v1/load_lora_adapter", lambda request: load_lora_adapter(ctx, request))
    app.router.add_post("/v1/unload_lora_adapter", lambda request: unload_lora_adapter(ctx, request))
