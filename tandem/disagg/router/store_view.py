"""The router's view of the tiered KV store: is a prompt's KV already there?

A request whose prompt, all but its last block, is in the store needs no prefill worker: a decode
worker loads that KV from the store, computes the few tokens left and decodes. The router keys the
prompt exactly as the workers do (their CoreInfo says how) and asks the same tiers they use.
"""

from __future__ import annotations

import logging

from tandem.config import EngineConfig
from tandem.engine.core_report import CoreInfo
from tandem.engine.core_request import EngineCoreRequest
from tandem.kv.hashing import block_keys
from tandem.kv.store.tiered import TieredStore, open_tiers

log = logging.getLogger(__name__)


class StoreView:
    def __init__(self, store: TieredStore, info: CoreInfo) -> None:
        self.store = store
        self.info = info

    @classmethod
    def open(cls, config: EngineConfig, info: CoreInfo) -> StoreView | None:
        settings = config.cache.store_settings()
        if not settings.enabled or not info.block_nbytes:
            return None
        try:
            ident = f"{info.block_key_extra[0] & (2**64 - 1):016x}-{info.block_nbytes}"
            return cls(TieredStore(open_tiers(settings, info.block_nbytes, ident), info.block_nbytes), info)
        except Exception as e:  # the router works without it: every request is prefilled
            log.warning("the router cannot see the KV store (%s: %s); no request skips its prefill",
                        type(e).__name__, e)
            return None

    def num_stored_tokens(self, request: EngineCoreRequest) -> int:
        """Leading prompt tokens whose KV the store holds, in whole blocks, short of the last token."""
        bs = self.info.block_size
        wanted = (request.num_prompt_tokens - 1) // bs
        keys = block_keys(request.prompt_token_ids[:wanted * bs], bs, self.info.hash_algo, self.info.block_key_extra,
                          request.cache_salt)
        return self.store.num_leading(keys) * bs

    def prefill_free(self, request: EngineCoreRequest) -> bool:
        """All of the prompt but its last block's tokens is stored (and there is more than that)."""
        stored = self.num_stored_tokens(request)
        return stored > 0 and request.num_prompt_tokens - stored <= self.info.block_size

    def close(self) -> None:
        self.store.close()
