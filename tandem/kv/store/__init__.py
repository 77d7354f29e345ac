"""The tiered KV store below the worker pools: host shared memory, local disk, Mooncake Store."""
