"""A vLLM KV connector that moves nothing: bench/vllm_kvbm.py's control. On vLLM 0.32's CPU runner a prompt
prefills about 1.8x faster with any KV connector attached than with none (measured 2026-12-01 on a 2-core CPU: 5.6 s vs
10.4 s for 1900 tokens, fp32), for a reason not found yet; comparing StrataKVConnector with this isolates what its
own copies cost. Imported only by vLLM's processes (kv_connector_module_path "bench.null_connector")."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata


class NullConnector(KVConnectorBase_V1):
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()
